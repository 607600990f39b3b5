"""A replica that joins a running swarm trains at the swarm's point of the learning-rate schedule: its first
round is not a warmup of its own, which would make its work look useless next to its peers' (docs/security.md,
"Send useless or harmful work")."""

from hetnode.config import replace
from hetnode.daemon.rounds import AnchorTraining
from hetnode.daemon.stage_training import StageTraining
from hetnode.data.dataset import TokenDataset
from hetnode.model.shards import ModelPart
from hetnode.replica.global_model import GlobalModel
from hetnode.training.schedule import warmup_cosine


def test_a_late_anchor_and_a_late_chain_stage_follow_the_swarms_schedule(tiny_config):
    config = replace(tiny_config, "outer", inner_steps=2)
    config = replace(config, "inner", warmup_steps=20)
    H, inner = config.outer.inner_steps, config.inner
    dataset = TokenDataset.build(config.data, config.model.vocab_size, config.run.seed)

    def swarm_lr(step: int) -> float:
        return warmup_cosine(step, inner.lr, inner.warmup_steps, config.train.max_steps, inner.min_lr_ratio)

    theta = GlobalModel(config)
    theta.params_round = 39  # the swarm is at round 40
    late = AnchorTraining(config, dataset, "late-anchor")
    late.run_round(40, theta)
    assert late.trainer.step == H  # its own count of steps: two
    lr = late.trainer.optimizer.param_groups[0]["lr"]
    assert lr == swarm_lr(40 * H + H - 1) and lr > 5 * swarm_lr(H - 1)  # not a warmup of its own

    early = AnchorTraining(config, dataset, "early-anchor")
    early.run_round(0, GlobalModel(config))  # a replica from round 0 keeps its own, identical count
    assert early.trainer.schedule_offset == 0
    assert early.trainer.optimizer.param_groups[0]["lr"] == swarm_lr(H - 1)

    splits = (range(0, 2), range(2, config.model.n_layers))
    stage = StageTraining(config, splits, 0, "c40-late", dataset)
    part = GlobalModel(config, part=ModelPart.of_stage(splits, 0))
    part.params_round = 39
    stage.rebase(stage.rebase_from(part))
    stage.begin_round(40)
    assert stage.worker.schedule_offset == 40 * H
