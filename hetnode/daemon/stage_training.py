"""One stage of a chain as compute: its layers' working weights, the stage worker, and the SparseLoCo
payload of its own shards. Blocking methods (run them in a worker thread); no networking here.

The stage's working weights live across rounds (`LocalRounds`, docs/sync.md "Overlap"), as an anchor's do:
`rebase` stands them on each new θ (its slice, projected into the chain's subspace where the constraint
applies — DESIGN §2.3) keeping the progress since the round began, between two micro-batches. A round:
`begin_round` sets the round's T_fix' from θ's embedding after the θ round the first stage names (every
stage of a compressed chain holds θ's embedding, `ModelPart.embed`: every stage of a round builds the
same T_fix' whatever θ each stands on, and no V×d frame crosses the chain), the chain pushes micro-batches
through `forward`/`backward`, and `end_round` compresses Δ = s − w of this stage's parameters with error
feedback and encodes one message per shard it owns ("embed" on the first stage, its blocks, "head" on the
last).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch

from hetnode.algo.sparseloco import ErrorFeedback, SparseLoCoCodec
from hetnode.config import Config
from hetnode.daemon.rounds import write_state
from hetnode.data.dataset import TokenDataset
from hetnode.errors import CheckpointError
from hetnode.model.decoder import layer_of
from hetnode.model.shards import ModelPart
from hetnode.model.subspace import SubspaceConstraint
from hetnode.planning.rounds import NUM_DATA_SLOTS, assigned_batches, data_slot
from hetnode.replica.global_model import GlobalModel, base_fixed_embedding
from hetnode.training.local_rounds import AheadFrom, LocalRounds, Rebase, snapshot_optimizer
from hetnode.training.stage_worker import Frame, build_stage_worker
from hetnode.training.working_copy import embedding_drift
from hetnode.wire.activation_frame import FrameLimits, value_bounds
from hetnode.wire.sync_payload import SyncPayload, encode_payload

log = logging.getLogger(__name__)

KEPT_EMBEDDINGS = 3  # θ rounds: the chain's stages stand at most a round or two apart under overlap


def drift_refusal(round_: int, base: int, oldest: int, newest: int) -> str | None:
    """Why a stage refuses the first stage's word that round `round_`'s T_fix' comes from θ after round
    `base` (None: taken). `oldest`: the first round this stage could still train; `newest`: the newest
    round it began or was named a θ round for (one drift frame a round, before its first act frame).

    An honest first stage names the θ it stands on, a round or two back (at most one round is unapplied);
    a θ further back than `KEPT_EMBEDDINGS` rounds is one no stage keeps. Whether a θ ahead of this stage
    is within reach is decided when the round opens (the chain's `_hold_embedding_after`)."""
    if round_ <= newest:
        return f"a second drift frame for round {round_} (this stage is at round {newest} already)"
    if round_ < oldest:
        return f"a drift frame for round {round_}, which is not the next round"
    if base < round_ - KEPT_EMBEDDINGS:
        return (
            f"round {round_}'s T_fix' from θ after round {base}: more than {KEPT_EMBEDDINGS} rounds back, "
            "where no stage keeps θ's embedding"
        )
    return None


def stage_part(splits: Sequence[range], index: int, compressed: bool) -> ModelPart:
    """What stage `index` holds of θ: its layers, and θ's embedding when boundaries are compressed."""
    return ModelPart.of_stage(splits, index, tracks_embedding=compressed)


def round_drift(constraint: SubspaceConstraint, embed: torch.Tensor) -> torch.Tensor:
    """T_S − P(T_S) of θ's embedding `embed`: what T_fix' adds to T_fix for a round (DESIGN §2.3)."""
    return embedding_drift(embed, constraint.project_tensor("embed.weight", embed))


def frame_limits(config: Config, compressed: bool) -> FrameLimits:
    """What a stage accepts from its neighbours: the chain's batch shape, width k or d, dtype and value
    bounds (from d) and, when compressed, the first stage's V×d embedding drift once per round."""
    max_act, max_grad = value_bounds(config.model.d_model)
    return FrameLimits(
        config.data.batch_size,
        config.data.seq_len,
        config.pipeline.subspace_rank if compressed else config.model.d_model,
        "bf16" if compressed else "fp32",
        config.model.vocab_size,
        int(config.network.max_frame_mb * 2**20),
        d_model=config.model.d_model if compressed else 0,
        max_act=max_act,
        max_grad=max_grad,
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
        ahead_from: AheadFrom = "eager",
    ) -> None:
        """`compress`: subspace-compressed boundaries; by default when the config's compression mode
        constrains chains (`selective` or `everything`); `ahead_from`: where a round ahead trains from
        until θ lands (`LocalRounds`)."""
        if len(splits) < 2:
            raise ValueError("a chain has at least two stages")
        if index == 0 and dataset is None:
            raise ValueError("the first stage reads the chain's data")
        p = config.pipeline
        self.compressed = p.compression != "none" if compress is None else compress
        self.config = config
        self.index = index
        self.last = index == len(splits) - 1
        self.device = device  # the stage's weights, U and T_fix, its forwards and backwards; θ stays on CPU
        self.worker = build_stage_worker(
            config,
            splits,
            index,
            p.chain_optimizer,
            compress=self.compressed,
            constrained=self.compressed,
            seed=config.run.seed,
            wire_dtype=torch.bfloat16 if self.compressed else torch.float32,
            device=device,
        )
        # the first stage on an accelerator reads no refusal flag per micro-batch: it steps on a zero
        # gradient instead and counts refusals on the device, read once a round (`end_round`)
        self.worker.defer_refusals = index == 0 and torch.device(device).type != "cpu"
        self.base_fixed = base_fixed_embedding(config)
        part = stage_part(splits, index, self.compressed)
        # what a saved state names (a state from before stages held the embedding restores its feedback only)
        self.part = [part.layers.start, part.layers.stop, part.first, part.last, part.embed]
        self.names = [name for name, _ in self.worker.stage.named_parameters()]
        self.shards: dict[str, list[str]] = {}
        for name in self.names:
            if layer_of(name) == "embed" and index != 0:
                continue  # a tied embedding on the last stage: the first stage syncs it
            self.shards.setdefault(layer_of(name), []).append(name)
        o = config.outer
        self.feedback = ErrorFeedback(SparseLoCoCodec(o.topk, o.tile), o.error_feedback)
        params = dict(self.worker.stage.named_parameters())
        self.local = LocalRounds(params, self.feedback, ahead_from, o.lr)
        self.drift: torch.Tensor | None = (
            None  # the round's T_S − P(T_S), from θ's embedding after `drift_base`
        )
        self.drift_base: int | None = None
        # θ's embedding after each of the newest θ rounds stood on: a stage ahead of the first by a round
        # still builds the round's T_fix' from the θ the first stage names
        self.embeddings: dict[int, torch.Tensor] = {}
        self.dataset = dataset
        self.chain = chain
        self.slot = data_slot(chain)
        self.next_mb = 0
        self.tokens = 0

    @property
    def limits(self) -> FrameLimits:
        return frame_limits(self.config, self.compressed)

    @property
    def needs_drift(self) -> bool:
        """This stage builds the round's T_fix' from the θ round the first stage names in its drift frame
        (every stage after the first, the last one's tied embedding included)."""
        return self.worker.constraint is not None and self.index > 0

    @torch.no_grad()
    def rebase_from(
        self, global_model: GlobalModel, left_out: tuple[int, ...] = (), contributors: int = 1
    ) -> Rebase:
        """θ (our slice) as this stage trains it: projected where constrained, copies throughout, so a later
        apply cannot change what the rebase carries. Call it while nothing steps θ."""
        theta = {n: t.detach().clone() for n, t in global_model.params.items()}
        c = self.worker.constraint
        reference = {
            n: (c.project_tensor(n, theta[n]).clone() if c is not None else theta[n].clone())
            for n in self.names
        }
        round_ = global_model.params_round
        share = 1.0 / max(1, contributors)
        return Rebase(round_, round_ + 1, reference, None, theta, global_model.seal_hash, left_out, share)

    def rebase(self, rebase: Rebase) -> None:
        """Stand on a new θ now, between two micro-batches (in-flight ones keep their stashed weights). The
        round's T_fix' stays: it changes only at a round's start, for every stage at once."""
        self.local.rebase(rebase)
        embed = rebase.theta.get("embed.weight")
        if embed is not None:  # a clone (`rebase_from`): a later apply cannot change it
            self.embeddings[rebase.round] = embed
            for old in sorted(self.embeddings)[:-KEPT_EMBEDDINGS]:
                del self.embeddings[old]

    @property
    def base(self) -> int:
        """The θ round the working weights stand on (−2: none yet)."""
        return self.local.base

    def begin_round(self, round_: int, drift_base: int | None = None) -> None:
        """Start round `round_` from the working weights, its T_fix' from θ's embedding: after the θ round
        we stand on (first stage, which then names it in `drift_base` for the chain) or after the first
        stage's `drift_base`. ValueError if we do not hold θ's embedding after that round."""
        if self.local.theta is None:
            raise RuntimeError("a stage trains only once it stands on θ (rebase first)")
        # the first stage feeds the round's assigned batches of the chain's slot (public: verifiable)
        o = self.config.outer
        H = o.inner_steps
        self.next_mb = assigned_batches(self.chain, round_, H, o.step_cap).start
        # a chain formed at round r trains at the swarm's point of the schedule, not in a warmup of its own
        self.worker.schedule_offset = max(0, round_ * H - self.worker.version)
        # paced: however many micro-batches the round has, it covers the round's part of the schedule
        self.worker.paced_round = (round_, self.worker.version, H, o.step_cap) if o.paced else None
        self.drift = self.drift_base = None
        c = self.worker.constraint
        if c is not None:
            if self.index == 0:
                drift_base = self.local.base
            elif drift_base is None:
                raise ValueError("a stage after the first needs the θ round of the first stage's drift")
            self.drift = round_drift(c, self.embedding_after(drift_base))
            self.drift_base = drift_base
            fixed = (self.base_fixed + self.drift).to(self.worker.device)  # once a round, not per batch
            self.worker.constraint = dataclasses.replace(c, fixed=fixed)
            if self.worker.stage.first:
                self.worker.stage.fixed_embedding = fixed
        self.worker.drop_in_flight()

    def embedding_after(self, round_: int) -> torch.Tensor:
        """θ's embedding after `round_` (one we stood on, among the newest `KEPT_EMBEDDINGS`)."""
        embed = self.embeddings.get(round_)
        if embed is None:
            held = sorted(self.embeddings)
            raise ValueError(f"no embedding of θ after round {round_} here (held: after {held})")
        return embed

    def next_batch(self) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        """The first stage's next micro-batch (index, (tokens, targets)) from the chain's data slot."""
        assert self.dataset is not None
        mb = self.next_mb
        batch = self.dataset.train_batch(self.slot, NUM_DATA_SLOTS, mb)
        self.next_mb += 1
        return mb, batch

    def forward(self, mb: int, incoming: Frame | tuple[torch.Tensor, torch.Tensor]) -> Frame | torch.Tensor:
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
        """This stage's compressed Δ for `round_`, one encoded message per shard it owns (the θ it was
        trained from in the header). Call it once θ of the round before is stood on."""
        if self.local.base != round_ - 1:
            raise RuntimeError(f"round {round_} is compressed on θ after round {round_ - 1}, not {self.base}")
        if self.worker.defer_refusals and (refused := self.worker.take_refusals()):
            log.warning(
                "round %d: %d micro-batches had gradients that were not finite: stepped on zero instead",
                round_,
                refused,
            )
        compressed = self.local.compress(round_)
        return {
            shard: encode_payload(
                SyncPayload(
                    replica,
                    round_,
                    shard,
                    "sparseloco",
                    {n: compressed[n] for n in names},
                    base=self.local.base,
                )
            )
            for shard, names in self.shards.items()
        }

    def local_state(self) -> dict:
        """What a restart needs to go on, as of the last rebase (copies: training goes on at once): our
        slice of θ and its round, the error feedback with every earlier payload settled, the stage's
        optimiser and schedule position, and the data position. Not the working weights: a restart
        stands on θ again."""
        p = self.local
        return {
            "part": self.part,
            "params_round": p.base,
            "seal_hash": p.base_seal,
            "global_params": p.theta,
            "feedback": self.feedback.state_dict(),
            "optimizer": snapshot_optimizer(self.worker.optimizer),
            "version": self.worker.version,
            "tokens": self.tokens,
            "next_mb": self.next_mb,
        }

    def save_local_state(self, path: Path) -> None:
        """Write `local_state` (to a file, then renamed: a crash never leaves half a state)."""
        write_state(path, self.local_state())

    def load_local_state(self, path: Path, global_model: GlobalModel) -> str | None:
        """Restore a saved state into `global_model` (stand on it with `rebase` next); returns what was
        restored, None when there is none.

        "all" for the same layers as before. A stage of another chain may hold other layers: then only
        the error feedback of the tensors it still holds is taken (what they still owe to θ); its θ comes
        from a catch-up and its optimiser starts afresh."""
        if not path.exists():
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            same = state["part"] == self.part
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
