"""Async GRPO: the producer generates while a slowed trainer trains, keep-mode pauses bracket the syncs, and no sample past max_staleness is trained on."""

from __future__ import annotations

import pytest
import torch

from trainers.async_rollouts import sample_staleness, stale_sample_weights
from trainers.common import single_reward
from trainers.config import LoggingConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig
from trainers.grpo import GRPOTrainer

NUM_prompts, GROUP = 2, 4
# A liveness guard for waits on the producer, not a timing assertion: a test that hits it has hung.
_WAIT_S = 120.0


def make_config(path: str, tmp_path, **rollout) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(path=path),
        rollout=RolloutConfig(
            num_prompts_per_step=NUM_prompts, num_samples_per_prompt=GROUP, max_tokens=8, max_model_len=128,
            async_mode=True, **rollout,
        ),
        optim=OptimConfig(lr=1e-3),
        logging=LoggingConfig(output_dir=str(tmp_path / "run"), save_final=False),
    )


def slow_down(trainer: GRPOTrainer, groups_to_wait_for, seen: list[dict]) -> None:
    """Replaces trainer._train by one that first blocks until the producer has finished
    `groups_to_wait_for(step)` groups (generation must run while the trainer is in its train phase),
    then trains as before; `seen` gets one record per step: the groups finished, the advantages."""
    train = trainer._train

    def slowed(batch, advantages):
        producer = trainer.producer
        want = groups_to_wait_for(trainer.step_count)
        finished_before = producer.num_finished
        reached = producer.wait_finished(want, timeout=_WAIT_S)
        seen.append({
            "step": trainer.step_count,
            "finished_before": finished_before,
            "finished_after": producer.num_finished,
            "want": want,
            "reached": reached,
            "advantages": advantages.clone(),
        })
        return train(batch, advantages)

    trainer._train = slowed


# ---- the staleness rules, alone ------------------------------------------------------------------


def test_sample_staleness_counts_versions_behind_from_the_oldest_token():
    index = {"default": 0, "step-1": 1, "step-2": 2}
    spans = [
        [("step-2", 0, 5)],                      # fresh
        [("step-1", 0, 3), ("step-2", 3, 6)],    # mixed: the oldest token decides
        [("default", 0, 2), ("step-2", 2, 4)],
    ]
    assert sample_staleness(spans, index, current=2) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"weight_versions\[0\].*'step-9'"):
        sample_staleness([[("step-9", 0, 1)]], index, current=2)
    with pytest.raises(ValueError, match=r"weight_versions\[0\]"):
        sample_staleness([[]], index, current=2)


def test_drop_and_downweight_rules():
    staleness = torch.tensor([0, 1, 2, 3])
    keep, weight = stale_sample_weights(staleness, 1, "drop", 0.5)
    assert keep.tolist() == [True, True, False, False] and weight.tolist() == [1.0, 1.0, 1.0, 1.0]
    keep, weight = stale_sample_weights(staleness, 1, "downweight", 0.5)
    assert keep.tolist() == [True] * 4 and weight.tolist() == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="policy"):
        stale_sample_weights(staleness, 1, "ignore", 0.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_staleness": -1}, "rollout.max_staleness"),
        ({"stale_policy": "keep"}, "rollout.stale_policy"),
        ({"stale_weight": 0.0}, "rollout.stale_weight"),
        ({"stale_weight": 1.5}, "rollout.stale_weight"),
        ({"async_lookahead": 0}, "rollout.async_lookahead"),
    ],
)
def test_async_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RolloutConfig(**kwargs)


def test_lookahead_defaults_to_one_past_the_staleness_bound():
    assert RolloutConfig(max_staleness=2).lookahead_steps == 3
    assert RolloutConfig(max_staleness=0, async_lookahead=4).lookahead_steps == 4


# ---- the trainer, end to end ---------------------------------------------------------------------


def test_async_generates_while_training_and_never_exceeds_max_staleness(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    config = make_config(tiny_checkpoint("llama"), tmp_path, max_staleness=1)  # lookahead 2 steps
    logged, histograms, seen = [], [], []
    with GRPOTrainer(config, single_reward(vowel_reward), log=lambda m, s: logged.append((m, s)),
                     log_histogram=lambda name, values, s: histograms.append((name, list(values), s))) as trainer:
        worker = trainer.worker
        with pytest.raises(ValueError, match="rollout.async_mode"):
            trainer.step(prompts[:2])

        # Every weight sync must happen inside a keep-mode pause.
        events = []
        pause, resume, send = worker.pause_generation, worker.resume_generation, trainer.sync.send_weights
        worker.pause_generation = lambda mode="abort": (events.append(("pause", mode)), pause(mode))[1]
        worker.resume_generation = lambda: (events.append(("resume",)), resume())[1]

        def send_weights(*args, **kwargs):
            events.append(("send", worker.is_paused()))
            return send(*args, **kwargs)

        trainer.sync.send_weights = send_weights
        # At step k the worker serves version k-1, so groups up to (k + 1) * NUM_prompts are admitted;
        # the slowed train phase waits until they finish: the producer must generate meanwhile.
        slow_down(trainer, lambda k: (k + 1) * NUM_prompts, seen)
        history = trainer.train(prompts, num_steps=4)

        assert trainer.producer is None  # stopped at the end of train()
        assert worker.get_weight_version() == "step-4"
        assert not worker.is_paused()

    assert events == [("pause", "keep"), ("send", True), ("resume",)] * 4
    # Generation ran concurrently with training: groups admitted by the last sync finished while
    # the trainer sat in its train phase (a serial pipeline would have hung here).
    assert all(r["reached"] for r in seen), seen
    assert any(r["finished_after"] > r["finished_before"] for r in seen[1:]), seen

    all_trained = []
    for step, metrics in enumerate(history, start=1):
        values = metrics["staleness/values"]
        assert len(values) == metrics["num_samples_trained"] == NUM_prompts * GROUP
        assert all(0 <= v <= 1 for v in values), (step, values)  # the bound, on every sample trained on
        assert metrics["staleness/max"] == max(values) and metrics["staleness/mean"] == pytest.approx(sum(values) / 8)
        assert metrics["num_stale_dropped"] == 0
        assert metrics["grad_norm"] > 0
        all_trained += values
    assert history[0]["staleness/values"] == [0] * 8  # the first step's samples come from the initial weights
    # Step 2 trains on groups generated ahead, while step 1 trained on version 0: one version behind.
    assert history[1]["staleness/max"] == 1
    assert set(all_trained) == {0, 1}

    # Scalars go to log, the per-sample staleness to log_histogram, once per step.
    assert [s for _, s in logged] == [1, 2, 3, 4]
    assert all(not isinstance(v, list) for m, _ in logged for v in m.values())
    assert all("staleness/mean" in m and "staleness/max" in m for m, _ in logged)
    assert [(name, s) for name, _, s in histograms] == [("staleness", s) for s in (1, 2, 3, 4)]
    assert [values for _, values, _ in histograms] == [m["staleness/values"] for m in history]


def _fill_the_lookahead_first(trainer, seen):
    # Step 1's train phase waits until every group admitted at version 0 has finished, so
    # step 2 finds only version-0 groups ahead of any submitted after the first sync.
    lookahead = trainer.config.rollout.lookahead_steps
    slow_down(trainer, lambda k: lookahead * NUM_prompts if k == 1 else 0, seen)


def test_drop_policy_trains_on_no_sample_past_the_bound(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    config = make_config(tiny_checkpoint("llama"), tmp_path, max_staleness=0, async_lookahead=3, stale_policy="drop")
    seen = []
    with GRPOTrainer(config, single_reward(vowel_reward), log=lambda m, s: None) as trainer:
        _fill_the_lookahead_first(trainer, seen)
        history = trainer.train(prompts, num_steps=3)
    assert seen[0]["reached"]
    assert history[0]["staleness/values"] == [0] * 8 and history[0]["num_samples_trained"] == 8
    # Step 2's groups were all generated by version 0 while version 1 is trained: all dropped.
    assert history[1]["num_stale_dropped"] == 8 and history[1]["num_samples_trained"] == 0
    assert history[1]["stale_fraction"] == 1.0
    for metrics in history:
        assert all(v == 0 for v in metrics["staleness/values"])  # nothing older than max_staleness=0 trained
        assert metrics["num_samples_trained"] + metrics["num_stale_dropped"] == 8


def test_downweight_policy_scales_stale_advantages(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    config = make_config(tiny_checkpoint("llama"), tmp_path, max_staleness=0, async_lookahead=3,
                         stale_policy="downweight", stale_weight=0.5)
    seen, rewards = [], []

    def reward(completions, items):
        values = [vowel_reward(c, i) for c, i in zip(completions, items)]
        rewards.append(torch.tensor(values))
        return values

    with GRPOTrainer(config, reward, log=lambda m, s: None) as trainer:
        _fill_the_lookahead_first(trainer, seen)
        history = trainer.train(prompts, num_steps=2)
        unweighted = [trainer._advantages(r) for r in rewards]
    assert [m["num_samples_trained"] for m in history] == [8, 8] and history[1]["num_stale_dropped"] == 0
    assert history[0]["staleness/values"] == [0] * 8 and history[0]["staleness/weight_mean"] == 1.0
    # Step 2 trains on version-0 samples one version past the bound: each advantage halved.
    assert history[1]["staleness/values"] == [1] * 8 and history[1]["staleness/weight_mean"] == 0.5
    assert unweighted[1].abs().sum() > 0
    torch.testing.assert_close(seen[0]["advantages"], unweighted[0])
    torch.testing.assert_close(seen[1]["advantages"], unweighted[1] * 0.5)
