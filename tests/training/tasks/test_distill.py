"""Knowledge distillation: the loss math, a frozen teacher, checkpoint validation, an end-to-end run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from neuron_train.common.errors import UsageError
from neuron_train.training.config_io import build_config
from neuron_train.training.models import build_model
from neuron_train.training.optim import build_optimizer
from neuron_train.training.tasks import build_task
from neuron_train.training.tasks.distill import distillation_losses
from tests.conftest import run_train, summary_of


def _softmax(xs: list[float]) -> list[float]:
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def _reference(student: list[float], teacher: list[float], label: int, alpha: float, t: float):
    """Hinton's loss for one sample, written out in plain Python floats."""
    p_s = _softmax([x / t for x in student])
    p_t = _softmax([x / t for x in teacher])
    kl = sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s, strict=True))
    kd = kl * t * t
    ce = -math.log(_softmax(student)[label])
    return alpha * kd + (1 - alpha) * ce, ce, kd


def test_loss_matches_a_hand_computed_reference():
    student = [[1.0, 2.0, -0.5, 0.3], [0.2, -1.0, 3.0, 0.0]]
    teacher = [[0.5, 3.0, -2.0, 1.0], [1.5, 0.0, 2.0, -1.0]]
    labels = [1, 3]
    alpha, t = 0.3, 2.5
    got = distillation_losses(torch.tensor(student), torch.tensor(teacher), torch.tensor(labels),
                              alpha, t)
    for i in range(2):
        loss, ce, kd = _reference(student[i], teacher[i], labels[i], alpha, t)
        assert got["loss"][i].item() == pytest.approx(loss, rel=1e-5)
        assert got["ce_loss"][i].item() == pytest.approx(ce, rel=1e-5)
        assert got["kd_loss"][i].item() == pytest.approx(kd, rel=1e-5)


def test_batch_mean_is_timm_style_batchmean_kl_times_t_squared():
    g = torch.Generator().manual_seed(0)
    s, te = torch.randn(8, 10, generator=g), torch.randn(8, 10, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    t = 4.0
    kd = distillation_losses(s, te, y, 1.0, t)["kd_loss"].mean()
    ref = F.kl_div(F.log_softmax(s / t, -1), F.log_softmax(te / t, -1), reduction="batchmean",
                   log_target=True) * t * t
    assert kd.item() == pytest.approx(ref.item(), rel=1e-5)


def test_alpha_ends_select_one_term_and_equal_logits_cost_no_kl():
    g = torch.Generator().manual_seed(1)
    s, te = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    y = torch.tensor([0, 1, 2, 3])
    only_kd = distillation_losses(s, te, y, 1.0, 3.0)
    only_ce = distillation_losses(s, te, y, 0.0, 3.0)
    assert torch.allclose(only_kd["loss"], only_kd["kd_loss"])
    assert torch.allclose(only_ce["loss"], F.cross_entropy(s, y, reduction="none"))
    same = distillation_losses(s, s.clone(), y, 0.5, 3.0)
    assert same["kd_loss"].abs().max().item() < 1e-5


def _teacher_file(tmp_path, name="vit-digits", classes=10, ours=True):
    model = build_model(name, num_classes=classes, img_size=32)
    path = tmp_path / f"{name}-{classes}.pt"
    # `ours`: the layout our loop's checkpoints have ({"model": state_dict, ...}).
    torch.save({"model": model.state_dict(), "position": {"step": 1}} if ours else model.state_dict(),
               path)
    return model, path


def _distill_cfg(path, name="vit-digits", **flags):
    return build_config(overrides={"distill.teacher_model": name, "distill.teacher_checkpoint": str(path),
                                   **flags})


def _cpu_task(cfg, student):
    return build_task(cfg, student, torch.device("cpu"), step=lambda: 0, mark_phase=lambda name: None)


def test_teacher_is_frozen_outside_the_optimizer_and_untouched_by_backward(tmp_path):
    reference, path = _teacher_file(tmp_path)
    cfg = _distill_cfg(path)
    student = build_model("vit-digits", num_classes=10, img_size=32)
    task = _cpu_task(cfg, student)
    teacher = task.teacher
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    for k, v in teacher.state_dict().items():  # every weight loaded from the checkpoint
        assert torch.equal(v, reference.state_dict()[k]), k
    optimizer = build_optimizer(student, cfg.optim)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in teacher.parameters()}
    assert not any(n.startswith("teacher") for n in student.state_dict())  # not a submodule
    losses = task(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    assert set(losses) == {"loss", "ce_loss", "kd_loss"}
    losses["loss"].backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    info = task.info()
    assert info["teacher_params"] == sum(p.numel() for p in reference.parameters())
    assert info["student_params"] == sum(p.numel() for p in student.parameters())


def test_teacher_bf16_computes_logits_in_bf16_close_to_fp32(tmp_path):
    _, path = _teacher_file(tmp_path, ours=False)
    student = build_model("vit-digits", num_classes=10, img_size=32)
    images = torch.randn(4, 3, 32, 32)
    fp32 = _cpu_task(_distill_cfg(path), student)
    bf16 = _cpu_task(_distill_cfg(path, **{"distill.teacher_bf16": True}), student)
    assert all(p.dtype == torch.bfloat16 for p in bf16.teacher.parameters())
    a, b = fp32.teacher_logits(images), bf16.teacher_logits(images)
    assert b.dtype == torch.float32  # cast back for the f32 loss
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.1)


def test_a_checkpoint_of_another_shape_is_refused_with_the_reason(tmp_path):
    _, path = _teacher_file(tmp_path)  # a vit-digits checkpoint
    student = build_model("vit-digits", num_classes=10, img_size=32)
    with pytest.raises(UsageError, match=r"does not fit --teacher-model vit-digits-teacher.*patch_embed"):
        _cpu_task(_distill_cfg(path, "vit-digits-teacher"), student)
    twelve = build_model("vit-digits", num_classes=12, img_size=32)
    with pytest.raises(UsageError, match=r"12 classes: head.weight \[10, 96\] in the file, \[12, 96\]"):
        _cpu_task(_distill_cfg(path), twelve)


def _one_line_usage_error(proc, needle):
    assert proc.returncode == 2, proc.stderr[-2000:]
    # A file saved without its checksum (torch.save here, as by another tool) adds a note line first.
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_missing_or_mismatched_teacher_checkpoint_exits_2_with_one_line(tmp_path):
    missing = run_train(tmp_path / "a", "--teacher-model", "vit-digits", "--teacher-checkpoint",
                        str(tmp_path / "nope.pt"))
    _one_line_usage_error(missing, "--teacher-checkpoint: no such file")
    _, path = _teacher_file(tmp_path)
    wrong = run_train(tmp_path / "b", "--teacher-model", "vit-digits-teacher", "--teacher-checkpoint",
                      str(path), "--max-steps", "2")
    _one_line_usage_error(wrong, "does not fit --teacher-model vit-digits-teacher")
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    unreadable = run_train(tmp_path / "c", "--teacher-model", "vit-digits", "--teacher-checkpoint",
                           str(garbage), "--max-steps", "2")
    _one_line_usage_error(unreadable, "cannot read weights")


@pytest.mark.slow
def test_distilled_run_end_to_end_reports_both_models_and_stays_on_its_graphs(tmp_path):
    _, path = _teacher_file(tmp_path, "vit-micro")
    out = tmp_path / "run"
    proc = run_train(out, "--teacher-model", "vit-micro", "--teacher-checkpoint", str(path),
                     "--distill-alpha", "0.7", "--distill-temperature", "2", "--max-steps", "8",
                     "--batch-size", "16", "--log-every", "1", "--eval-every", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(out)
    assert s["teacher_model"] == "vit-micro" and s["student_params"] == s["params"]
    assert s["teacher_params"] > s["student_params"] > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 8
    for r in train:  # the logged total is the alpha mix of the logged parts
        assert r["loss"] == pytest.approx(0.7 * r["kd_loss"] + 0.3 * r["ce_loss"], rel=1e-4)
    graphs = json.loads((out / "graphs.json").read_text())["graphs"]
    assert all(g["step"] <= 1 for g in graphs if g["phase"] == "train"), graphs
