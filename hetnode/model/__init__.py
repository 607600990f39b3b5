"""The decoder model and its split into pipeline stages."""

from hetnode.model.decoder import DecoderStage, build_model, build_stages, count_parameters, layer_of

__all__ = ["DecoderStage", "build_model", "build_stages", "count_parameters", "layer_of"]
