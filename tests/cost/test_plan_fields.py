"""plan traces the loop's own step (training/build.py): every setting training/config.py marks `graph=`
moves plan's counted facts, or plan_measure.SAME_COST declares, with the reason, that it does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from neuron_train.cost.plan.measure import SAME_COST
from neuron_train.training.config import RunConfig, sections

# graph= field -> (the configuration it is changed in, the change); dotted section.field keys, over BASE
BASE = {"model.name": "vit-nano", "train.batch_size": 8}   # a one-block model: a trace takes seconds
TEACHER = {"distill.teacher_model": "vit-nano", "distill.teacher_checkpoint": "<teacher>"}
RELATIVE = {"sift.sift": "relative"}
VARIANTS: dict[str, tuple[dict, dict]] = {
    "model.name": ({}, {"model.name": "vit-digits"}),
    "model.img_size": ({}, {"model.img_size": 48}),
    "model.num_classes": ({}, {"model.num_classes": 20}),
    "model.drop_path": ({"model.name": "vit-digits"}, {"model.drop_path": 0.1}),  # timm: no drop in a 1-block model
    "data.batches_per_execution": ({"train.step_compiler": "lazy"}, {"data.batches_per_execution": 2}),
    "optim.optimizer": ({}, {"optim.optimizer": "sgd"}),
    "optim.grad_clip": ({}, {"optim.grad_clip": 0.0}),
    "optim.zero1": ({}, {"optim.zero1": True}),
    "optim.optimizer_impl": ({}, {"optim.optimizer_impl": "flat"}),
    "train.batch_size": ({}, {"train.batch_size": 16}),
    "train.grad_accum": ({}, {"train.grad_accum": 2}),
    "train.precision": ({}, {"train.precision": "bf16-autocast"}),
    "train.step_compiler": ({}, {"train.step_compiler": "lazy"}),
    "distill.teacher_model": ({}, TEACHER),
    "distill.teacher_bf16": (TEACHER, {"distill.teacher_bf16": True}),
    "sift.sift": ({}, {"sift.sift": "topk"}),
    "sift.sift_keep": ({"sift.sift": "topk"}, {"sift.sift_keep": 0.25}),
    "sift.sift_beta": (RELATIVE, {"sift.sift_beta": 2.0}),
    "sift.sift_history": (RELATIVE, {"sift.sift_history": 100}),
    "recipe.mixup": ({}, {"recipe.mixup": 0.8}),
    "recipe.model_ema": ({}, {"recipe.model_ema": True}),
}


def graph_fields() -> list[str]:
    return [f"{section}.{f.name}" for section in sections()
            for f in dataclasses.fields(getattr(RunConfig(), section)) if f.metadata.get("graph")]


def configured(values: dict, teacher: Path) -> RunConfig:
    by_section: dict[str, dict] = {}
    for dotted, value in {**BASE, **values}.items():
        section, name = dotted.split(".")
        by_section.setdefault(section, {})[name] = str(teacher) if value == "<teacher>" else value
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in by_section.items()})
    return cfg.validate()


def test_every_graph_field_has_a_variant_and_every_declaration_names_a_graph_field():
    """Fails when a graph= field is added without a variant here (then: see plan's facts move, or
    declare it in plan_measure.SAME_COST with the reason)."""
    fields = graph_fields()
    assert sorted(VARIANTS) == sorted(fields), "a graph= field without a variant in this test, or one too many"
    assert set(SAME_COST) <= set(fields)


_COUNTED: dict[RunConfig, dict] = {}  # the base configurations are shared: each traced once


def facts(cfg: RunConfig) -> dict:
    """What plan counts for the configuration's training step (its name and wording left out)."""
    from neuron_train.cost.plan import measure as plan_measure

    if cfg not in _COUNTED:
        figures, details = plan_measure.measure_loop(cfg)
        counted = dataclasses.asdict(figures)
        del counted["name"], counted["measured_by"]
        _COUNTED[cfg] = {**counted, **details["hlo"]}
    return _COUNTED[cfg]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    import torch

    from neuron_train.training.models import build_model

    path = tmp_path_factory.mktemp("teacher") / "teacher.pt"
    torch.save(build_model("vit-nano", num_classes=10, img_size=32).state_dict(), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_plans_counted_facts_move_with_every_graph_field_unless_declared_not_to(field, teacher):
    base, change = VARIANTS[field]
    before, after = facts(configured(base, teacher)), facts(configured({**base, **change}, teacher))
    moved = sorted(k for k in before if before[k] != after[k])
    if field in SAME_COST:
        assert not moved, f"{field} is declared not to change cost ({SAME_COST[field]}), but moves {moved}"
    else:
        assert moved, (f"{field} changes the graphs but not what plan counts: make plan trace it "
                       "(training/build.py), or declare it in plan_measure.SAME_COST with the reason")


@pytest.mark.slow
def test_an_optimizer_step_of_two_micro_batches_counts_twice_their_matmuls_and_samples(teacher):
    """The update has no matrix multiply (clipping and AdamW are element-wise): two micro-batches are
    exactly twice one's dot FLOPs, for twice the samples, and one update's weights and state."""
    one, two = facts(configured({}, teacher)), facts(configured({"train.grad_accum": 2}, teacher))
    assert two["flops_per_step"] == 2 * one["flops_per_step"] > 0
    assert two["samples_per_step"] == 2 * one["samples_per_step"] == 2 * BASE["train.batch_size"]
    assert two["input_bytes"] == 2 * one["input_bytes"]
    assert (two["param_bytes"], two["optimizer_bytes"], two["grad_accumulation"]) == (
        one["param_bytes"], one["optimizer_bytes"], 1)
