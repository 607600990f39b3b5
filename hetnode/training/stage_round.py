"""One stage of a chain as compute, as every chain member computes it: its layers' working weights, the stage
worker, and its Δ with error feedback. Blocking methods (run them in a worker thread); no networking here.

The stage's working weights live across rounds (`LocalRounds`, docs/sync.md "Overlap"), as an anchor's do:
`rebase` stands them on each new θ (its slice, projected into the chain's subspace where the constraint
applies — docs/chains.md, "Subspace-compressed boundaries") keeping the progress since the round began,
between two micro-batches. A round: `begin_round` sets the round's T_fix' from θ's embedding after the θ round
the first stage names (every stage of a compressed chain holds θ's embedding, `ModelPart.embed`: every stage
of a round builds the same T_fix' whatever θ each stands on, and no V×d frame crosses the chain), the chain
pushes micro-batches through `forward`/`backward` (the first stage reads the round's assigned batches of the
chain's data slot), and `compress` gives Δ = s − w of this stage's parameters with error feedback, per shard
it owns ("embed" on the first stage, its blocks, "head" on the last: `shards`).

The daemon's chain member (`hetnode/daemon/stage_training.py`) adds the payload messages, frame limits and
the state file; the lab's in-process chains (`hetnode/lab/sim/`) drive the same object.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from hetnode.algo.sparseloco import CompressedTensor, ErrorFeedback, SparseLoCoCodec
from hetnode.config import Config
from hetnode.data.dataset import TokenDataset
from hetnode.model.decoder import layer_of
from hetnode.model.shards import ModelPart
from hetnode.model.subspace import SubspaceConstraint
from hetnode.planning.rounds import NUM_DATA_SLOTS, assigned_batches, data_slot
from hetnode.replica.global_model import base_fixed_embedding
from hetnode.training.anchor_round import Theta
from hetnode.training.local_rounds import AheadFrom, LocalRounds, Rebase
from hetnode.training.stage_worker import Frame, build_stage_worker
from hetnode.training.working_copy import embedding_drift

log = logging.getLogger(__name__)

KEPT_EMBEDDINGS = 3  # θ rounds: the chain's stages stand at most a round or two apart under overlap


def stage_part(splits: Sequence[range], index: int, compressed: bool) -> ModelPart:
    """What stage `index` holds of θ: its layers, and θ's embedding when boundaries are compressed."""
    return ModelPart.of_stage(splits, index, tracks_embedding=compressed)


def round_drift(constraint: SubspaceConstraint, embed: torch.Tensor) -> torch.Tensor:
    """T_S − P(T_S) of θ's embedding `embed`: what T_fix' adds to T_fix for a round (docs/chains.md,
    "Subspace-compressed boundaries")."""
    return embedding_drift(embed, constraint.project_tensor("embed.weight", embed))


class StageRound:
    """One stage of a chain as compute: its layers' working weights across rounds, the stage worker, its
    round's T_fix', its Δ with error feedback (the caller encodes it)."""

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
        """`chain`: the chain's lineage (`planning.roles.lineage_of`), whose data slot the first stage reads
        and which a successor keeps; `compress`: subspace-compressed boundaries; by default when the
        config's compression mode constrains chains (`selective` or `everything`); `ahead_from`: where a
        round ahead trains from until θ lands (`LocalRounds`)."""
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
        # gradient instead and counts refusals on the device, read once a round (`compress`)
        self.worker.defer_refusals = index == 0 and torch.device(device).type != "cpu"
        self.base_fixed = base_fixed_embedding(config)
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
        self._handed: dict[str, torch.Tensor] | None = None  # a predecessor's feedback, not yet added
        # θ's embedding after each of the newest θ rounds stood on: a stage ahead of the first by a round
        # still builds the round's T_fix' from the θ the first stage names
        self.embeddings: dict[int, torch.Tensor] = {}
        self.dataset = dataset
        self.chain = chain
        self.slot = data_slot(chain)
        self.next_mb = 0
        self.tokens = 0

    @property
    def needs_drift(self) -> bool:
        """This stage builds the round's T_fix' from the θ round the first stage names in its drift frame
        (every stage after the first, the last one's tied embedding included)."""
        return self.worker.constraint is not None and self.index > 0

    @torch.no_grad()
    def rebase_from(
        self, global_model: Theta, left_out: tuple[int, ...] = (), contributors: int = 1
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
        seal_hash = getattr(global_model, "seal_hash", None)
        return Rebase(round_, round_ + 1, reference, None, theta, seal_hash, left_out, share)

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
        self.worker.schedule_offset = max(0, round_ * H - self.worker.applied)
        # paced: however many micro-batches the round has, it covers the round's part of the schedule
        self.worker.paced_round = (round_, self.worker.applied, H, o.step_cap) if o.paced else None
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

    def compress(self, round_: int) -> dict[str, CompressedTensor]:
        """This stage's Δ of round `round_`, compressed with error feedback (kept until its round is
        settled). Call it once θ of the round before is stood on."""
        if self.local.base != round_ - 1:
            raise RuntimeError(f"round {round_} is compressed on θ after round {round_ - 1}, not {self.base}")
        if self.worker.defer_refusals and (refused := self.worker.take_refusals()):
            log.warning(
                "round %d: %d micro-batches had gradients that were not finite: stepped on zero instead",
                round_,
                refused,
            )
        if (handed := self._handed) is not None:
            self._handed = None
            self.local.add_feedback(handed)
        return self.local.compress(round_)

    def hand_over(self, feedback: dict[str, torch.Tensor]) -> None:
        """The error feedback a predecessor at our stage left (`daemon.feedback_handoff`, checked there):
        what its rounds still owe θ, added to ours by the next `compress`, in the training thread that
        owns the buffers (so it may be handed over while a round trains)."""
        self._handed = feedback

    def feedback_norm(self) -> float:
        buffers = self.feedback.buffers.values()
        return float(sum(b.pow(2).sum() for b in buffers) ** 0.5) if buffers else 0.0
