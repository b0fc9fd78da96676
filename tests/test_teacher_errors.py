"""Errors about a teacher's tensors name the teacher's arguments.

The teacher head is checked by the same head contract as the student's; its messages used to
name the student's arguments ("labels must have shape [4]" for a teacher_hidden with the
wrong row count, "hidden, weight ... must be on one device" for a teacher on another device,
a teacher weight's dtype blamed on ``weight``). Each case: ``linear_divergence`` raises
``ValueError`` naming ``teacher_hidden`` / ``teacher_weight`` / ``teacher_bias``, with what was
expected and what was given; the student's own errors still name ``hidden`` / ``weight``.
"""

from __future__ import annotations

import re

import pytest
import torch

import logitless

N, H, HT, V = 5, 8, 12, 20


def _inputs():
    g = torch.Generator().manual_seed(0)
    student = dict(
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        labels=torch.randint(0, V, (N,), generator=g),
    )
    teacher = dict(
        teacher_hidden=torch.randn(N, HT, generator=g),
        teacher_weight=torch.randn(V, HT, generator=g),
        teacher_bias=torch.randn(V, generator=g),
    )
    return student, teacher


# case -> (changes to the teacher's tensors, the message expected)
CASES = {
    "rows": (
        {"teacher_hidden": torch.randn(N - 1, HT)},
        rf"teacher_hidden must have one row per label position, shape \[{N}, {HT}\] .* got "
        rf"\[{N - 1}, {HT}\]",
    ),
    "device_of_weight": (
        {"teacher_weight": torch.randn(V, HT, device="meta")},
        r"teacher_hidden, teacher_weight, labels, teacher_bias and temperature must be on one "
        r"device, got \['cpu', 'meta'\]",
    ),
    "dtype_of_weight": (
        {"teacher_weight": torch.randn(V, HT).bfloat16()},
        r"teacher_hidden \(torch.float32\) and teacher_weight \(torch.bfloat16\) must share",
    ),
    "dtype_of_bias": (
        {"teacher_bias": torch.randn(V).double()},
        r"teacher_bias \(torch.float64\) and teacher_weight \(torch.float32\) must share a dtype",
    ),
    "width": (
        {"teacher_weight": torch.randn(V, HT - 2)},
        rf"teacher_weight must be \[V, H\] with H = teacher_hidden's last dimension \({HT}\)",
    ),
    "weight_not_2d": (
        {"teacher_weight": torch.randn(V)},
        r"teacher_weight must be a floating \[V, H\] tensor, got dtype torch.float32 and shape "
        rf"\[{V}\]",
    ),
    "hidden_integer": (
        {"teacher_hidden": torch.ones(N, HT, dtype=torch.long)},
        r"teacher_hidden must be a floating tensor of shape \[\.\.\., H\], got dtype torch.int64",
    ),
    "hidden_not_a_tensor": (
        {"teacher_hidden": [[0.0] * HT] * N},
        r"teacher_hidden must be a torch.Tensor, got list",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_linear_divergence_names_the_teacher(case):
    student, teacher = _inputs()
    changes, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        logitless.linear_divergence(**student, **(teacher | changes))


def test_fused_policy_loss_with_a_teacher_head_names_the_teacher():
    student, teacher = _inputs()
    bad = logitless.TeacherHead(torch.randn(N - 1, HT), teacher["teacher_weight"])
    old, adv = torch.zeros(N), torch.ones(N)
    with pytest.raises(ValueError, match=r"teacher_hidden must have one row per label position"):
        logitless.fused_policy_loss(
            *student.values(), old, adv,
            config=logitless.PolicyLossConfig(distill_coef=0.1), teacher=bad,
        )  # fmt: skip


@pytest.mark.parametrize(
    "student_change, message",
    [
        ({"weight": torch.randn(V, H).bfloat16()}, r"^hidden \(torch.float32\) and weight \("),
        ({"labels": torch.zeros(N - 1, dtype=torch.long)}, r"^labels must have shape \[5\]"),
        ({"weight": torch.randn(V, H, device="meta")}, r"^hidden, weight, labels, bias and"),
    ],
)
def test_the_students_errors_still_name_the_students_arguments(student_change, message):
    student, teacher = _inputs()
    with pytest.raises(ValueError, match=message) as err:
        logitless.linear_divergence(**(student | student_change), **teacher)
    assert not re.search(r"teacher_(hidden|weight|bias)", str(err.value))
