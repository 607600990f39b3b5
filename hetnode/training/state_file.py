"""A nested state (dicts, lists, numbers, strings, tensors: what `optimizer.state_dict()` holds) as one
safetensors file: the tensors as its entries, everything else as a JSON skeleton in its header.

Not a pickle: reading a state file runs no code, whoever wrote it. Dict keys keep their type (an
optimizer's state is keyed by int parameter indices, which `load_state_dict` matches by value), so a
dict is stored as a list of [key, value] pairs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hetnode.errors import CheckpointError
from hetnode.files import atomic_write

FORMAT = "hetnode-state/1"
_TENSOR, _DICT = "$tensor", "$dict"


def save_state(path: Path, state: Any) -> None:
    """Write `state` to `path` atomically (temp file + rename): a crash leaves the old file or the new."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def encode(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = name if name not in tensors else f"{name}#{len(tensors)}"
            tensor = value.detach().to("cpu").contiguous()
            storage = tensor.untyped_storage().data_ptr()
            if storage in seen:  # tied weights, views of one buffer: safetensors refuses shared memory
                tensor = tensor.clone()
            seen.add(tensor.untyped_storage().data_ptr())
            tensors[key] = tensor
            return {_TENSOR: key}
        if isinstance(value, dict):
            return {_DICT: [[k, encode(v, f"{name}.{k}")] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return [encode(v, f"{name}.{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise TypeError(f"{name}: cannot store a {type(value).__name__} in a state file")

    skeleton = json.dumps(encode(state, "state"))
    metadata = {"format": FORMAT, "skeleton": skeleton}
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_state(path: Path) -> Any:
    """The state `save_state` wrote (tensors on the CPU); CheckpointError if the file is missing or is
    not a state file."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file (format: {metadata.get('format')!r})")

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if isinstance(value, dict) and _TENSOR in value:
            if value[_TENSOR] not in tensors:
                raise CheckpointError(f"{path}: names a tensor it does not hold ({value[_TENSOR]!r})")
            return tensors[value[_TENSOR]]
        if isinstance(value, dict) and _DICT in value:
            return {k: decode(v) for k, v in value[_DICT]}
        return value

    try:
        return decode(json.loads(metadata.get("skeleton", "")))
    except (ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: its state header is damaged ({type(exc).__name__})") from None
