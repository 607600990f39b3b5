"""Run configuration: one frozen dataclass per component, loaded from TOML and validated on load.

Validation is strict on purpose: an unknown key, a wrong type or an impossible value raises one
`ConfigError` naming the file and the dotted key, so a typo in a volunteer's config never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hetnode.errors import ConfigError


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 320
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 352
    max_seq_len: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class DataConfig:
    # "wiki" (bundled Wikipedia summaries), "dir:<folder of .txt/.jsonl>", "parquet:<file or folder>",
    # "arrow:<file or folder>" (Arrow IPC), "hf:<dataset name or local path>", "bin:<uint16 token file>",
    # or "tokens:<folder>" (shards and tokenizer from `hetnode data prepare`)
    source: str = "wiki"
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    bpe_vocab_size: int = 4096
    seq_len: int = 128
    batch_size: int = 16
    eval_fraction: float = 0.02
    data_dir: str = "~/.cache/hetnode"
    text_column: str = "text"  # the text of parquet/arrow/hf rows and .jsonl records
    max_documents: int = 0  # read at most this many documents, in source order (0: all)
    hf_split: str = "train"  # hf: the split to stream
    hf_subset: str = ""  # hf: the dataset's configuration ("" for its default)
    # tokens: the sha256 of the folder's tokenizer.json, so each peer's copy is the run's ("" with bytes)
    tokenizer_sha256: str = ""


@dataclass(frozen=True)
class InnerConfig:
    """The inner (local) optimiser and its schedule."""

    optimizer: Literal["adamw", "nadam", "rotated_adamw"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 20
    nadam_beta1: float = 0.99  # the Nesterov baseline for async pipelines (arXiv 2602.03515)
    rotation: Literal["two_sided", "one_sided"] = "two_sided"  # rotated_adamw only
    rotation_refresh: int = 10  # steps between basis refreshes
    rotation_decay: float = 0.999  # decay of the GG^T / G^TG statistics
    # Most FLOPs the rotation may add to a step (6·params·tokens), per matrix: two-sided, else one-sided,
    # else one-sided in diagonal blocks (algo/rotation_cost.py); applied where a step's tokens are known.
    rotation_budget: float = 0.10


@dataclass(frozen=True)
class TrainConfig:
    """The local training loop (also the inner loop that anchors and chains run)."""

    max_steps: int = 300
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 100
    log_every: int = 10
    # The coordinator evaluates θ (and draws its sample) after every this many sealed rounds, not after
    # each: with a real held-out set (`eval_batches`) evaluation costs more than the round's scoring.
    eval_every_rounds: int = 1
    # The most passes over the training tokens max_steps may make (max_steps · batch · seq / train tokens);
    # a bigger run refuses to start, so a large model never memorises a small corpus by accident. 0: off.
    max_epochs: float = 0.0


@dataclass(frozen=True)
class OuterConfig:
    """SparseLoCo outer sync (docs/sync.md)."""

    inner_steps: int = 30  # H
    topk: int = 64  # kept entries per 4096-element tile
    tile: int = 64  # tile side; a 2-D tile is tile x tile
    error_feedback: float = 0.95  # beta
    lr: float = 1.0  # alpha
    weight_decay: float = 0.0
    # The coordinator writes θ to disk every this many sealed rounds (and when it stops); after a crash
    # it takes the rounds it missed from the replicas, so K trades disk writes for catch-up downloads.
    checkpoint_every_rounds: int = 5
    # How many of those checkpoints (DATA_DIR/checkpoints/round-NNNNNN/) the coordinator keeps, newest
    # first: more than one, so that a damaged newest checkpoint falls back to the one before it.
    keep_checkpoints: int = 3
    # The largest |shift| + max|table| a contribution's 2-bit quantisation may carry (docs/security.md, "Crash
    # the coordinator or a replica with one payload"): honest pseudo-gradients sit far below 1; the bound
    # keeps every aggregate and θ − α·Δ finite in float32.
    max_value: float = 1000.0
    # The coordinator scores every contribution and gives no weight or credit to work that does not help
    # (docs/security.md, "Send useless or harmful work": stale, copied, free-riding or harmful updates); off
    # only to measure what it prevents.
    verify: bool = True
    # How many replicas the coordinator scores in one round, on average (a chain counts once). Small swarms
    # are scored whole; in larger ones each replica is drawn with chance verify_sample · w / W (its share of
    # the round's earned weight; equal weights: verify_sample / R), never below
    # `verify_min_chance`, from a secret after the announcements are fixed: nobody can tell when it will be
    # scored next, whatever it saw before (cost: about max(verify_sample, verify_min_chance · R) a round).
    verify_sample: int = 16
    verify_min_chance: float = 0.25
    # Weight is earned by verified history (docs/security.md, "Free identities"): a new identity is on
    # probation (scored, not sealed) until a round of its scores non-negative, then weighs 1 and gains 1 per
    # such round up to this; a negative score halves what it earned (not below 1), and a score far below a
    # free rider's (a strike) halves this ceiling for good. Weight, not headcount, is what the aggregate,
    # the clip and the verifier's medians count, and credit goes with it.
    probation_rounds: int = 8
    # How each coordinate combines the contributions, after every contribution is scaled down to the median
    # norm (docs/security.md, "Steer the update", docs/sync.md). "mean" (default, the SparseLoCo paper's
    # (1/N)Σ): each identity holds 1/N of the update and moves Δ by at most 1/N of the median norm.
    # "selectors": the mean over the peers that selected a coordinate (hetnode's rule before; one identity on
    # a support nobody else chose moves θ by the whole median norm). "pooled": the sum over the tensor's mean
    # number of selectors per selected coordinate (fair like "mean", steps like "selectors"; unstable in
    # BENCHMARKS.md). "clip": each value capped at the median peer's largest |value|, then "selectors".
    # "trimmed": the top and bottom 20 % of a coordinate's N values dropped. The manifest carries it, so every
    # replica uses the same rule.
    aggregation: Literal["selectors", "mean", "pooled", "clip", "trimmed"] = "mean"
    # A replica that has announced round t trains round t+1 at once from its own working weights and
    # rebases onto θ^t when the seal lands, keeping its progress since announcing (docs/sync.md,
    # "Overlap"); at most one unapplied round ahead. false: the lockstep round (train, wait, apply).
    overlap: bool = False
    # How long a round's training is (docs/sync.md, "Paced rounds"). "steps": every replica trains exactly
    # inner_steps (H) a round, so a round lasts as long as the slowest replica. "paced": the sealer
    # publishes with each seal a time budget for the rounds to come (the time the replica at
    # budget_quantile of the swarm, by weight and counted from the fastest, takes for H steps, within
    # [min_round_s, max_round_s]); each replica trains as many steps as
    # fit, between min_inner_steps and max_inner_steps, and sits a round out when even the floor will not
    # fit. The learning-rate schedule then moves by sealed round, not by a replica's own step count.
    schedule: Literal["steps", "paced"] = "steps"
    min_inner_steps: int = 0  # paced: the floor (0: H // 4, at least 1)
    max_inner_steps: int = 0  # paced: the cap, and the stride of a round's batches (0: 2 · H)
    min_round_s: float = 0.5  # paced: the budget's bounds
    max_round_s: float = 600.0
    # paced: whose H steps a round's budget is sized for, by weight from the fastest. 0.5: the typical
    # replica trains H a round and a faster one up to the cap; 0.25: the fastest quarter trains H and the
    # rest fewer: shorter rounds, better loss per token (fewer local steps between syncs), more rounds to
    # sync, which overlap hides while a round outlasts its sync (benchmarks/paced_weighting.py)
    budget_quantile: float = 0.5

    @property
    def paced(self) -> bool:
        return self.schedule == "paced"

    @property
    def step_floor(self) -> int:
        """The fewest inner steps a replica announces (H under "steps")."""
        if not self.paced:
            return self.inner_steps
        return self.min_inner_steps or max(1, self.inner_steps // 4)

    @property
    def step_cap(self) -> int:
        """The most inner steps a replica trains in a round, and how far apart the batches of successive
        rounds start (H under "steps": the batches are those of before)."""
        if not self.paced:
            return self.inner_steps
        return self.max_inner_steps or 2 * self.inner_steps


@dataclass(frozen=True)
class PipelineConfig:
    stages: int = 2
    subspace_rank: int = 16
    compression: Literal["none", "selective", "everything"] = "selective"
    chain_optimizer: Literal["adamw", "nadam", "rotated_adamw"] = "rotated_adamw"
    # Unanswered micro-batches on a networked chain's first stage. 0: the 1F1B schedule (P − s on stage s,
    # weight delay P−1−s); a larger W hides WAN latency and adds W − P updates of staleness on every stage.
    max_in_flight: int = 0
    # Workers a stage past the first may have (a pool, all with the stage's layers). Above 1, idle peers
    # join the pools of live chains' slowest stages (compute per layer) before another chain forms, and a
    # chain goes on with a worker of a pool gone (docs/chains.md, "Pools and routing").
    stage_workers: int = 1
    # Of the micro-batches a stage routes to a pool, the share also sent to a second worker, unknown to
    # both: two honest workers' gradients agree, a gradient sent with its sign flipped does not; of three,
    # the odd one is caught lying (docs/chains.md, "Second opinions"). Each copy costs the pool a
    # micro-batch of compute; 0 asks none.
    audit_share: float = 0.03125


@dataclass(frozen=True)
class NetworkConfig:
    anchor_min_up_mbps: float = 500.0
    anchor_min_down_mbps: float = 500.0
    stage_min_up_mbps: float = 5.0
    max_frame_mb: float = 64.0
    heartbeat_s: float = 10.0
    record_ttl_s: float = 30.0
    # Once a peer's role and the swarm's membership stop changing, its record heartbeats and its reads of
    # the others' records stretch from `heartbeat_s` up to this (records then live
    # record_ttl_s × stable_heartbeat_s / heartbeat_s, at most 120 s); any change brings them back to
    # `heartbeat_s`.
    stable_heartbeat_s: float = 60.0
    # Roles and chains change only at boundaries; while the swarm is not training the coordinator
    # opens one every `boundary_s` seconds. Chain members must all confirm within `confirm_s`.
    boundary_s: float = 30.0
    confirm_s: float = 10.0
    probe_mb: float = 4.0  # bytes each way per probe target
    probe_s: float = 5.0  # time bound per probe direction
    requests_per_min: int = 1200  # per remote peer, per handler (a round fetches one stream per shard)
    # The coordinator serves circuit relay: a volunteer that no new connection reaches (NAT, firewall)
    # holds a slot on it and is reached through it. Read by the coordinator only (a joining peer's
    # p2pd starts before it reads the manifest; anchors opt in with `hetnode join --relay-service`).
    relay_service: bool = True


@dataclass(frozen=True)
class SamplesConfig:
    """The coordinator's short text from θ after every evaluated round (status page, `rounds.jsonl`), so
    people see the model learn. Seeded by run seed + round: a round's sample can be repeated."""

    prompt: str = "The history of"
    tokens: int = 64  # new tokens per sample (a forward pass each, no KV cache); 0: no samples
    temperature: float = 0.8  # 0: greedy


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path) -> Config:
    """Load and validate a TOML run config; raise `ConfigError` naming the file and key at fault."""
    path = Path(path)
    shown = str(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(shown, "<file>", "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(shown, "<file>", f"not valid TOML ({exc})") from None
    return config_from_dict(raw, source=shown)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    config = _build(Config, raw, source, prefix="")
    validate(config, source)
    return config


def dump_config(config: Config) -> str:
    """TOML text that `load_config` reads back to an equal config (every field is a plain scalar)."""
    lines = []
    for section, fields in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in fields.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def replace(config: Config, section: str, **changes: Any) -> Config:
    """Return a copy of `config` with some fields of one section changed, validated again."""
    new = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **changes)})
    validate(new, "<override>")
    return new


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(
            source, prefix.rstrip(".") or "<root>", f"expected a table, got {type(raw).__name__}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(source, prefix + key, f"unknown key (known here: {known})")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        hint = hints[name]
        dotted = prefix + name
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, source, dotted + ".")
        else:
            values[name] = _coerce(hint, value, source, dotted)
    return cls(**values)


def _coerce(hint: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(source, key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"union config types are not supported ({key})")
    # bool is a subclass of int in Python; a config must not accept `true` for a number or vice versa.
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"unsupported config type {hint!r} ({key})")
    if not ok:
        raise ConfigError(source, key, f"expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _require(condition: bool, source: str, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(source, key, message)


DATA_SOURCE_KINDS = ("dir", "bin", "parquet", "arrow", "hf", "tokens")
DATA_SOURCE_FORMS = (
    "'wiki', 'dir:<path>', 'parquet:<path>', 'arrow:<path>', 'hf:<name or path>', 'bin:<path>' "
    "or 'tokens:<folder>'"
)
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def validate(config: Config, source: str) -> None:
    """Check the values that no type can express (ranges and cross-field rules)."""
    m, d, t, i, o, p, n = (
        config.model,
        config.data,
        config.train,
        config.inner,
        config.outer,
        config.pipeline,
        config.network,
    )
    _require(bool(config.run.name.strip()), source, "run.name", "must not be empty")
    _require(config.run.seed >= 0, source, "run.seed", f"must be >= 0, got {config.run.seed}")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
        value = getattr(m, key)
        _require(value > 0, source, f"model.{key}", f"must be > 0, got {value}")
    _require(m.vocab_size <= 65536, source, "model.vocab_size", "must fit uint16 token ids (<= 65536)")
    _require(
        m.d_model % m.n_heads == 0,
        source,
        "model.d_model",
        f"must be divisible by model.n_heads ({m.d_model} % {m.n_heads} != 0)",
    )
    _require(
        m.head_dim % 2 == 0, source, "model.n_heads", "head dimension d_model/n_heads must be even (RoPE)"
    )
    _require(m.rope_theta > 0, source, "model.rope_theta", "must be > 0")
    _require(0 < m.norm_eps < 1, source, "model.norm_eps", "must be in (0, 1)")
    _require(m.init_std > 0, source, "model.init_std", "must be > 0")

    _require(
        d.tokenizer != "bytes" or m.vocab_size >= 257,
        source,
        "model.vocab_size",
        f"must be >= 257 for the byte tokenizer (256 bytes + end-of-text), got {m.vocab_size}",
    )
    _require(
        d.tokenizer != "bpe" or d.bpe_vocab_size <= m.vocab_size,
        source,
        "data.bpe_vocab_size",
        f"must be <= model.vocab_size ({d.bpe_vocab_size} > {m.vocab_size})",
    )
    _require(d.bpe_vocab_size >= 260, source, "data.bpe_vocab_size", "must be >= 260")
    _require(d.seq_len > 0, source, "data.seq_len", f"must be > 0, got {d.seq_len}")
    _require(
        d.seq_len <= m.max_seq_len,
        source,
        "data.seq_len",
        f"must be <= model.max_seq_len ({d.seq_len} > {m.max_seq_len})",
    )
    _require(d.batch_size > 0, source, "data.batch_size", f"must be > 0, got {d.batch_size}")
    _require(
        0 < d.eval_fraction < 0.5, source, "data.eval_fraction", f"must be in (0, 0.5), got {d.eval_fraction}"
    )
    kind, sep, rest = d.source.partition(":")
    src_ok = d.source == "wiki" or (bool(sep) and kind in DATA_SOURCE_KINDS and bool(rest.strip()))
    _require(src_ok, source, "data.source", f"must be {DATA_SOURCE_FORMS}, got {d.source!r}")
    _require(bool(d.text_column.strip()), source, "data.text_column", "must name a column")
    _require(d.max_documents >= 0, source, "data.max_documents", f"must be >= 0, got {d.max_documents}")
    _require(bool(d.hf_split.strip()), source, "data.hf_split", "must name a split")
    _require(
        d.tokenizer_sha256 == "" or bool(SHA256.match(d.tokenizer_sha256)),
        source,
        "data.tokenizer_sha256",
        f"must be empty or 64 lowercase hex digits, got {d.tokenizer_sha256!r}",
    )

    _require(i.lr > 0, source, "inner.lr", f"must be > 0, got {i.lr}")
    _require(0 <= i.min_lr_ratio <= 1, source, "inner.min_lr_ratio", "must be in [0, 1]")
    for key in ("beta1", "beta2"):
        _require(0 <= getattr(i, key) < 1, source, f"inner.{key}", "must be in [0, 1)")
    _require(i.eps > 0, source, "inner.eps", "must be > 0")
    _require(i.weight_decay >= 0, source, "inner.weight_decay", "must be >= 0")
    _require(i.grad_clip >= 0, source, "inner.grad_clip", "must be >= 0 (0 disables clipping)")
    _require(i.warmup_steps >= 0, source, "inner.warmup_steps", "must be >= 0")
    _require(0 <= i.nadam_beta1 < 1, source, "inner.nadam_beta1", "must be in [0, 1)")
    _require(i.rotation_refresh >= 1, source, "inner.rotation_refresh", "must be >= 1")
    _require(0 <= i.rotation_decay < 1, source, "inner.rotation_decay", "must be in [0, 1)")
    _require(i.rotation_budget > 0, source, "inner.rotation_budget", f"must be > 0, got {i.rotation_budget}")

    counts = ("max_steps", "eval_every", "eval_batches", "checkpoint_every", "log_every", "eval_every_rounds")
    for key in counts:
        value = getattr(t, key)
        _require(value > 0, source, f"train.{key}", f"must be > 0, got {value}")
    _require(
        0 <= t.max_epochs <= 1e6,  # also refuses NaN
        source,
        "train.max_epochs",
        f"must be in [0, 1e6] (0: no limit), got {t.max_epochs}",
    )

    _require(o.inner_steps > 0, source, "outer.inner_steps", f"must be > 0, got {o.inner_steps}")
    _require(
        1 <= o.tile <= 64, source, "outer.tile", f"must be in [1, 64] (12-bit tile indices), got {o.tile}"
    )
    _require(
        1 <= o.topk <= o.tile * o.tile,
        source,
        "outer.topk",
        f"must be in [1, tile*tile={o.tile * o.tile}], got {o.topk}",
    )
    _require(0 <= o.error_feedback < 1, source, "outer.error_feedback", "must be in [0, 1)")
    _require(o.lr > 0, source, "outer.lr", f"must be > 0, got {o.lr}")
    _require(
        o.checkpoint_every_rounds >= 1,
        source,
        "outer.checkpoint_every_rounds",
        f"must be >= 1, got {o.checkpoint_every_rounds}",
    )
    _require(
        o.keep_checkpoints >= 1, source, "outer.keep_checkpoints", f"must be >= 1, got {o.keep_checkpoints}"
    )
    _require(o.weight_decay >= 0, source, "outer.weight_decay", "must be >= 0")
    _require(o.verify_sample >= 1, source, "outer.verify_sample", f"must be >= 1, got {o.verify_sample}")
    _require(
        0 < o.verify_min_chance <= 1,
        source,
        "outer.verify_min_chance",
        f"must be in (0, 1], got {o.verify_min_chance}",
    )
    _require(
        1 <= o.probation_rounds <= 1024,
        source,
        "outer.probation_rounds",
        f"must be in [1, 1024], got {o.probation_rounds}",
    )
    _require(0 < o.max_value <= 1e30, source, "outer.max_value", f"must be in (0, 1e30], got {o.max_value}")
    rules = typing.get_args(typing.get_type_hints(OuterConfig)["aggregation"])
    _require(o.aggregation in rules, source, "outer.aggregation", f"must be one of {list(rules)}")
    schedules = typing.get_args(typing.get_type_hints(OuterConfig)["schedule"])
    _require(o.schedule in schedules, source, "outer.schedule", f"must be one of {list(schedules)}")
    for key in ("min_inner_steps", "max_inner_steps"):
        _require(getattr(o, key) >= 0, source, f"outer.{key}", "must be >= 0 (0: the default)")
    _require(
        o.step_floor <= o.inner_steps <= o.step_cap,
        source,
        "outer.min_inner_steps",
        f"must satisfy min_inner_steps <= inner_steps <= max_inner_steps, got {o.step_floor} <= "
        f"{o.inner_steps} <= {o.step_cap}",
    )
    _require(
        not o.paced or o.step_cap * o.probation_rounds <= 1024,
        source,
        "outer.max_inner_steps",
        "times outer.probation_rounds must be <= 1024 under paced rounds (a seal's weight counts steps), "
        f"got {o.step_cap} x {o.probation_rounds}",
    )
    _require(
        0 < o.budget_quantile <= 1,
        source,
        "outer.budget_quantile",
        f"must be in (0, 1] (the share of the swarm's weight, from the fastest), got {o.budget_quantile}",
    )
    _require(
        0 < o.min_round_s <= o.max_round_s <= 86400,
        source,
        "outer.min_round_s",
        f"must satisfy 0 < min_round_s <= max_round_s <= 86400, got {o.min_round_s}, {o.max_round_s}",
    )

    _validate_samples(config.samples, source)

    _require(p.stages >= 1, source, "pipeline.stages", f"must be >= 1, got {p.stages}")
    _require(
        p.stages <= m.n_layers,
        source,
        "pipeline.stages",
        f"must be <= model.n_layers ({p.stages} > {m.n_layers}); every stage needs a layer",
    )
    _require(
        1 <= p.subspace_rank < m.d_model,
        source,
        "pipeline.subspace_rank",
        f"must be in [1, model.d_model), got {p.subspace_rank}",
    )
    _require(p.stage_workers >= 1, source, "pipeline.stage_workers", "must be >= 1 (1: one peer per stage)")
    _require(0.0 <= p.audit_share <= 1.0, source, "pipeline.audit_share", "must be within 0..1")
    _require(p.max_in_flight >= 0, source, "pipeline.max_in_flight", "must be >= 0 (0: the 1F1B schedule)")

    for key in (
        "anchor_min_up_mbps",
        "anchor_min_down_mbps",
        "stage_min_up_mbps",
        "max_frame_mb",
        "heartbeat_s",
        "record_ttl_s",
        "stable_heartbeat_s",
        "boundary_s",
        "confirm_s",
        "probe_mb",
        "probe_s",
        "requests_per_min",
    ):
        value = getattr(n, key)
        _require(value > 0, source, f"network.{key}", f"must be > 0, got {value}")
    _require(
        n.stage_min_up_mbps <= n.anchor_min_up_mbps,
        source,
        "network.stage_min_up_mbps",
        "must be <= network.anchor_min_up_mbps",
    )
    _require(
        n.record_ttl_s > n.heartbeat_s,
        source,
        "network.record_ttl_s",
        "must be > network.heartbeat_s, or records expire between heartbeats",
    )
    _require(
        n.stable_heartbeat_s >= n.heartbeat_s,
        source,
        "network.stable_heartbeat_s",
        "must be >= network.heartbeat_s (the stable swarm's heartbeat is the slower one)",
    )
    _require(
        n.confirm_s < n.boundary_s,
        source,
        "network.confirm_s",
        "must be < network.boundary_s, or a chain cannot confirm before the next boundary",
    )


MAX_SAMPLE_TOKENS = 256  # a sample is a glimpse; sampling runs after every round on the coordinator's CPU
MAX_SAMPLE_PROMPT = 200  # characters


def _validate_samples(s: SamplesConfig, source: str) -> None:
    _require(
        0 <= s.tokens <= MAX_SAMPLE_TOKENS,
        source,
        "samples.tokens",
        f"must be in [0, {MAX_SAMPLE_TOKENS}] (0: no samples), got {s.tokens}",
    )
    _require(
        0 <= s.temperature <= 10, source, "samples.temperature", f"must be in [0, 10], got {s.temperature}"
    )
    _require(
        s.tokens == 0 or bool(s.prompt.strip()),
        source,
        "samples.prompt",
        "must not be empty while samples.tokens > 0",
    )
    _require(
        len(s.prompt) <= MAX_SAMPLE_PROMPT,
        source,
        "samples.prompt",
        f"must be at most {MAX_SAMPLE_PROMPT} characters, got {len(s.prompt)}",
    )
