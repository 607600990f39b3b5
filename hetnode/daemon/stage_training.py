"""One stage of a chain as compute: its layers' working copy of θ, the stage worker, and the SparseLoCo
payload of its own shards. Blocking methods (run them in a worker thread); no networking here.

A round: `begin_round` copies θ (projected into the chain's subspace where the constraint applies, with
the drift-corrected T_fix' — DESIGN §2.3) into the stage; the chain pushes micro-batches through
`forward`/`backward`; `end_round` compresses Δ = reference − local of this stage's parameters with error
feedback and encodes one message per shard it owns ("embed" on the first stage, its blocks, "head" on the
last).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch

from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback, SparseLoCoCodec, pseudo_gradient
from hetnode.config import Config
from hetnode.daemon.rounds import NUM_DATA_SLOTS, data_slot
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.model.decoder import layer_of
from hetnode.planning.rounds import assigned_batches
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.training.stage_worker import Frame, build_stage_worker
from hetnode.training.working_copy import WorkingCopy, embedding_drift
from hetnode.wire.activation_frame import FrameLimits
from hetnode.wire.sync_payload import SyncPayload, encode_payload


def frame_limits(config: Config, compressed: bool) -> FrameLimits:
    """What a stage accepts from its neighbours: the chain's batch shape, width k or d, and dtype (and,
    when compressed, the first stage's V×d embedding drift once per round)."""
    return FrameLimits(
        config.data.batch_size,
        config.data.seq_len,
        config.pipeline.subspace_rank if compressed else config.model.d_model,
        "bf16" if compressed else "fp32",
        config.model.vocab_size,
        int(config.network.max_frame_mb * 2**20),
        d_model=config.model.d_model if compressed else 0,
    )


class StageTraining:
    def __init__(
        self,
        config: Config,
        splits: Sequence[range],
        index: int,
        chain: str,
        dataset: TokenDataset | None,
        device: str = "cpu",
        compress: bool | None = None,
    ) -> None:
        """`compress`: subspace-compressed boundaries; by default when the config's compression mode
        constrains chains (`selective` or `everything`)."""
        if len(splits) < 2:
            raise ValueError("a chain has at least two stages")
        if index == 0 and dataset is None:
            raise ValueError("the first stage reads the chain's data")
        p = config.pipeline
        self.compressed = p.compression != "none" if compress is None else compress
        self.config = config
        self.index = index
        self.last = index == len(splits) - 1
        self.device = device  # the stage runs on CPU tensors today; kept for the record and the ledger
        self.worker = build_stage_worker(
            config,
            splits,
            index,
            p.chain_optimizer,
            compress=self.compressed,
            constrained=self.compressed,
            seed=config.run.seed,
            wire_dtype=torch.bfloat16 if self.compressed else torch.float32,
        )
        self.working = WorkingCopy(self.worker.constraint, base_fixed_embedding(config))
        self.names = [name for name, _ in self.worker.stage.named_parameters()]
        self.shards: dict[str, list[str]] = {}
        for name in self.names:
            if layer_of(name) == "embed" and index != 0:
                continue  # a tied embedding on the last stage: the first stage syncs it
            self.shards.setdefault(layer_of(name), []).append(name)
        o = config.outer
        self.feedback = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback)
        self.reference: dict[str, torch.Tensor] = {}
        self.drift: torch.Tensor | None = None  # the first stage's T_S − P(T_S) of the round
        self.dataset = dataset
        self.chain = chain
        self.slot = data_slot(chain)
        self.next_mb = 0
        self.tokens = 0
        self._unsent: dict[str, CompressedTensor] = {}

    @property
    def limits(self) -> FrameLimits:
        return frame_limits(self.config, self.compressed)

    @property
    def needs_drift(self) -> bool:
        """This stage builds T_fix' from the first stage's drift frame (it has no embedding of its own)."""
        return self.worker.constraint is not None and "embed.weight" not in self.names

    def begin_round(self, global_model: GlobalModel, drift: torch.Tensor | None = None) -> None:
        """Load θ (the stage's slice) into the stage, projected where constrained, and the round's T_fix'
        (from our embedding, or from the first stage's `drift`). Afterwards `drift` holds what the first
        stage sends down the chain for this round (None elsewhere, or when nothing is constrained)."""
        reference, fixed = self.working.prepare(global_model.params, drift)
        # the first stage feeds the round's assigned batches of the chain's slot (public: verifiable)
        round_ = global_model.params_round + 1
        self.next_mb = assigned_batches(self.chain, round_, self.config.outer.inner_steps).start
        # a chain formed at round r trains at the swarm's point of the schedule, not in a warmup of its own
        H = self.config.outer.inner_steps
        self.worker.schedule_offset = max(0, round_ * H - self.worker.version)
        self.drift = None
        if self.index == 0 and self.worker.constraint is not None:
            self.drift = embedding_drift(global_model.params["embed.weight"], reference["embed.weight"])
        self.reference = {n: reference[n] for n in self.names}
        stage = self.worker.stage
        with torch.no_grad():
            for name, param in stage.named_parameters():
                param.copy_(self.reference[name])
        if fixed is not None:
            if self.worker.constraint is not None:
                self.worker.constraint = dataclasses.replace(self.worker.constraint, fixed=fixed)
            if stage.first:
                stage.fixed_embedding = fixed
        self.worker.drop_in_flight()

    def next_batch(self) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        """The first stage's next micro-batch (index, (tokens, targets)) from the chain's data slot."""
        assert self.dataset is not None
        mb = self.next_mb
        batch = self.dataset.train_batch(self.slot, NUM_DATA_SLOTS, mb)
        self.next_mb += 1
        return mb, batch

    def forward(self, mb: int, incoming: Frame | tuple[torch.Tensor, torch.Tensor]) -> Frame | float:
        tokens = incoming[0] if isinstance(incoming, tuple) else incoming.tokens
        self.tokens += tokens.numel()
        return self.worker.forward(mb, incoming)

    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.worker.backward(mb, grad)

    def weight_delays(self, since: int = 0) -> dict[str, float | int | None]:
        """The max and mean weight-version delay of the backward passes after the first `since` ones."""
        delays = [delay for _, delay in self.worker.staleness[since:]]
        if not delays:
            return {"max_weight_delay": None, "mean_weight_delay": None}
        return {"max_weight_delay": max(delays), "mean_weight_delay": round(sum(delays) / len(delays), 3)}

    def in_flight(self, mb: int) -> bool:
        return mb in self.worker.in_flight

    def end_round(self, round_: int, replica: str) -> dict[str, bytes]:
        """This stage's compressed Δ for `round_`, one encoded message per shard it owns."""
        local = {n: p.detach().cpu() for n, p in self.worker.stage.named_parameters()}
        compressed = self.feedback.compress(pseudo_gradient(self.reference, local))
        self._unsent = compressed
        return {
            shard: encode_payload(
                SyncPayload(replica, round_, shard, "sparseloco", {n: compressed[n] for n in names})
            )
            for shard, names in self.shards.items()
        }

    def save_local_state(self, path: Path, global_model: GlobalModel) -> None:
        """What a restart needs to go on, as an anchor saves it: our slice of θ and its round, error
        feedback, the stage's optimiser and schedule position, and the data position."""
        p = global_model.part
        state = {
            "part": [p.layers.start, p.layers.stop, p.first, p.last],
            "params_round": global_model.params_round,
            "seal_hash": global_model.seal_hash,
            "global_params": global_model.params,
            "feedback": self.feedback.state_dict(),
            "optimizer": self.worker.optimizer.state_dict(),
            "version": self.worker.version,
            "tokens": self.tokens,
            "next_mb": self.next_mb,
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    def load_local_state(self, path: Path, global_model: GlobalModel) -> str | None:
        """Restore a saved state; returns what was restored, None when there is none.

        "all" for the same layers as before. A stage of another chain may hold other layers: then only
        the error feedback of the tensors it still holds is taken (what they still owe to θ); its θ comes
        from a catch-up and its optimiser starts afresh."""
        if not path.exists():
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            p = global_model.part
            same = state["part"] == [p.layers.start, p.layers.stop, p.first, p.last]
            feedback = state["feedback"]
            held = {n: b for n, b in feedback["buffers"].items() if n in self.names}
            if any(tuple(b.shape) != tuple(global_model.params[n].shape) for n, b in held.items()):
                raise CheckpointError(f"{path} was saved for another model")
            self.feedback.load_state_dict({"beta": feedback["beta"], "buffers": held})
            if not same:
                return "feedback"
            params = state["global_params"]
            if {n: tuple(t.shape) for n, t in params.items()} != {
                n: tuple(t.shape) for n, t in global_model.params.items()
            }:
                raise CheckpointError(f"{path} was saved for another model")
            self.worker.optimizer.load_state_dict(state["optimizer"])
            self.worker.version = int(state["version"])
            self.tokens, self.next_mb = int(state["tokens"]), int(state["next_mb"])
        except (OSError, KeyError, RuntimeError, ValueError, TypeError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"{path} is unreadable ({exc}); move it away to start fresh") from None
        with torch.no_grad():
            for name, tensor in params.items():
                global_model.params[name].copy_(tensor)
        global_model.params_round = int(state["params_round"])
        seal_hash = state.get("seal_hash")
        global_model.seal_hash = seal_hash if isinstance(seal_hash, str) else None
        global_model.changed()
        return "all"

    def feedback_norm(self) -> float:
        buffers = self.feedback.buffers.values()
        return float(sum(b.pow(2).sum() for b in buffers) ** 0.5) if buffers else 0.0

    def restore_unsent(self) -> None:
        """The last payload was not sealed: add it back to the error-feedback buffers."""
        self.feedback.restore(self._unsent)
        self._unsent = {}
