"""Bad input to the head raises ValueError naming the argument, in the op and the reference alike.

One test per check in ``logitless.contract.head``; every test runs against both functions, which
share those checks. The DTensor check needs a process group: it is in test_vocab_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import reference

V, H, N = 11, 8, 5
FUNCS = [logitless.linear_logprobs, reference.linear_logprobs]
FUNC_IDS = ["op", "reference"]


@pytest.fixture(params=FUNCS, ids=FUNC_IDS)
def head(request):
    return request.param


def _good(**overrides):
    """A valid call's arguments, with some of them replaced."""
    args = {
        "hidden": torch.randn(N, H),
        "weight": torch.randn(V, H),
        "labels": torch.randint(0, V, (N,)),
    }
    args.update(overrides)
    return args


def _call(head, **overrides):
    args = _good(**overrides)
    return head(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_valid_call_passes(head):
    # The baseline the error tests perturb is itself accepted.
    out = _call(head, bias=torch.randn(V), temperature=torch.rand(N) + 0.5, softcap=5.0)
    assert out.logprobs.shape == (N,)


# ---- not tensors -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hidden", "weight", "labels", "bias"])
def test_not_a_tensor(head, name):
    value = _good(bias=torch.randn(V))[name].tolist()
    with pytest.raises(ValueError, match=rf"{name} must be a torch\.Tensor, got list"):
        _call(head, **{name: value})


# ---- hidden / weight ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "hidden",
    [torch.randint(0, 3, (N, H)), torch.tensor(1.0)],
    ids=["integer", "0-dim"],
)
def test_hidden_not_floating_or_no_dims(head, hidden):
    with pytest.raises(
        ValueError, match=r"hidden must be a floating tensor of shape \[\.\.\., H\]"
    ):
        _call(head, hidden=hidden)


@pytest.mark.parametrize(
    "weight",
    [torch.randn(V * H), torch.randn(2, V, H), torch.randint(0, 3, (V, H))],
    ids=["1-d", "3-d", "integer"],
)
def test_weight_not_floating_2d(head, weight):
    with pytest.raises(ValueError, match=r"weight must be a floating \[V, H\] tensor"):
        _call(head, weight=weight)


def test_hidden_last_dim_mismatch(head):
    match = rf"weight must be \[V, H\] with H = hidden's last dimension \({H + 1}\)"
    with pytest.raises(ValueError, match=match):
        _call(head, hidden=torch.randn(N, H + 1))


def test_weight_given_as_h_by_v_says_transposed(head):
    """A [H, V] weight (the transpose of nn.Linear(H, V).weight) is named as such."""
    weight = torch.randn(V, H).t()
    with pytest.raises(ValueError, match=r"weight must be \[V, H\].*looks transposed.*weight\.T"):
        _call(head, weight=weight)


# ---- labels ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels_shape", [(N + 1,), (N, 1), (1, N)], ids=["longer", "extra-dim", "transposed"]
)
def test_labels_shape_mismatch(head, labels_shape):
    with pytest.raises(ValueError, match=rf"labels must have shape \[{N}\]"):
        _call(head, labels=torch.zeros(labels_shape, dtype=torch.long))


def test_labels_shape_mismatch_3d(head):
    with pytest.raises(ValueError, match=r"labels must have shape \[2, 3\]"):
        _call(head, hidden=torch.randn(2, 3, H), labels=torch.zeros(3, 2, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_labels_not_integer(head, dtype):
    with pytest.raises(ValueError, match=r"labels must be an integer tensor"):
        _call(head, labels=torch.zeros(N, dtype=dtype))


@pytest.mark.parametrize("bad", [-1, -101, V, V + 100], ids=["-1", "-101", "V", "V+100"])
def test_label_out_of_range(head, bad):
    labels = torch.randint(0, V, (N,))
    labels[2] = bad
    with pytest.raises(ValueError, match=rf"labels must be in \[0, {V}\).*e\.g\. {bad}"):
        _call(head, labels=labels)


def test_default_ignore_index_is_out_of_range_under_another_ignore_index(head):
    labels = torch.randint(0, V, (N,))
    labels[0] = -100
    with pytest.raises(ValueError, match=r"labels must be in .*ignore_index=-1"):
        _call(head, labels=labels, ignore_index=-1)


@pytest.mark.parametrize("ignore_index", [-100.0, True, "x", None])
def test_ignore_index_not_int(head, ignore_index):
    with pytest.raises(ValueError, match=r"ignore_index must be an int"):
        _call(head, ignore_index=ignore_index)


# ---- devices and dtypes ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hidden", "weight", "labels", "bias", "temperature"])
def test_device_mismatch(head, name):
    # A CPU-only machine still has two devices: "meta" tensors carry shape and dtype only.
    args = _good(bias=torch.randn(V), temperature=torch.rand(N) + 0.5)
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=r"must be on one device, got \['cpu', 'meta'\]"):
        _call(head, **args)


def test_dtype_mismatch_without_head_dtype(head):
    with pytest.raises(
        ValueError, match=r"hidden \(torch\.bfloat16\) and weight \(torch\.float32\)"
    ):
        _call(head, hidden=torch.randn(N, H, dtype=torch.bfloat16))


@pytest.mark.parametrize("head_dtype", [torch.int32, torch.bool, "float32", 4])
def test_head_dtype_not_floating(head, head_dtype):
    with pytest.raises(ValueError, match=r"head_dtype must be None or a floating torch\.dtype"):
        _call(head, head_dtype=head_dtype)


def test_head_dtype_allows_mixed_dtypes(head):
    out = _call(
        head,
        hidden=torch.randn(N, H, dtype=torch.bfloat16),
        bias=torch.randn(V, dtype=torch.bfloat16),
        head_dtype=torch.float32,
    )
    assert out.logprobs.dtype == torch.float32


# ---- bias --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bias",
    [torch.randn(V + 1), torch.randn(1, V), torch.randn(()), torch.zeros(V, dtype=torch.long)],
    ids=["V+1", "1xV", "0-dim", "integer"],
)
def test_bias_wrong_shape_or_dtype(head, bias):
    with pytest.raises(ValueError, match=rf"bias must be a floating tensor of shape \[{V}\]"):
        _call(head, bias=bias)


def test_bias_dtype_mismatch_without_head_dtype(head):
    with pytest.raises(ValueError, match=r"bias \(torch\.float64\) and weight \(torch\.float32\)"):
        _call(head, bias=torch.randn(V, dtype=torch.float64))


# ---- temperature -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), True, "1.0", None])
def test_scalar_temperature_not_positive_finite(head, temperature):
    with pytest.raises(ValueError, match=r"temperature must be a positive finite float"):
        _call(head, temperature=temperature)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_temperature_tensor_not_positive_finite(head, bad):
    temperature = torch.rand(N) + 0.5
    temperature[3] = bad
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0 everywhere"):
        _call(head, temperature=temperature)


def test_a_temperature_whose_reciprocal_overflows_the_logits_is_refused(head):
    """Issue 52: logits / T overflow fp32 (inf, then NaN) below 1 / finfo(fp32).max; refused as
    a scalar and in a per-token tensor. In a float64 head the same value is fine; 1e-8, the
    value of the report, gives finite log-probs, the exact distribution at that temperature
    (about -1e9 for a token that is not the argmax: docs/head.md, "Temperature")."""
    tiny = 1e-39  # 1 / tiny > 3.4e38 = finfo(float32).max
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0 everywhere"):
        _call(head, temperature=tiny)
    per_token = torch.ones(N)
    per_token[2] = tiny
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0 everywhere"):
        _call(head, temperature=per_token)
    args = {k: v.double() if v.is_floating_point() else v for k, v in _good().items()}
    assert torch.isfinite(_call(head, **args, temperature=tiny).logprobs).all()
    out = _call(head, temperature=1e-8).logprobs
    assert torch.isfinite(out).all() and out.min() < -1e5


# 2xN: broadcast_shapes accepts it, but temperature may not add dimensions to labels.
@pytest.mark.parametrize("shape", [(N + 1,), (N, 2), (2, N)], ids=["N+1", "Nx2", "2xN"])
def test_temperature_tensor_not_broadcastable(head, shape):
    with pytest.raises(ValueError, match=r"temperature of shape .* is not broadcastable"):
        _call(head, temperature=torch.rand(shape) + 0.5)


def test_temperature_tensor_integer(head):
    with pytest.raises(ValueError, match=r"temperature tensor must be floating"):
        _call(head, temperature=torch.ones(N, dtype=torch.long))


def test_temperature_requires_grad(head):
    with pytest.raises(ValueError, match=r"temperature must not require grad"):
        _call(head, temperature=(torch.rand(N) + 0.5).requires_grad_())


# ---- softcap -----------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.0, -3.0, float("nan"), float("inf"), True, "30"])
def test_softcap_not_positive_finite(head, softcap):
    with pytest.raises(ValueError, match=r"softcap must be a positive finite float"):
        _call(head, softcap=softcap)


# ---- chunk_size --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True, "8", 8.0])
def test_chunk_size_invalid(head, chunk_size):
    with pytest.raises(ValueError, match=r"chunk_size must be None or an int >= 1"):
        _call(head, chunk_size=chunk_size)


@pytest.mark.parametrize("with_entropy", [1, "yes", None])
def test_with_entropy_not_bool(head, with_entropy):
    with pytest.raises(ValueError, match=r"with_entropy must be a bool"):
        _call(head, with_entropy=with_entropy)


def _zero3_partition(shape) -> torch.nn.Parameter:
    """What a DeepSpeed ZeRO-3 parameter is outside a gather: an empty ``.data``, its whole
    shape in ``ds_shape`` and its status (read by attribute: no DeepSpeed needed)."""
    from types import SimpleNamespace

    p = torch.nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_shape, p.ds_status = 0, torch.Size(shape), SimpleNamespace(name="NOT_AVAILABLE")
    return p


def test_zero3_partition_is_refused_naming_the_fix(head):
    with pytest.raises(
        ValueError,
        match=r"weight is a DeepSpeed ZeRO-3 parameter that is not "
        r"gathered \(shape \[0\] here, \[11, 8\] whole\).*GatheredParameters",
    ):
        _call(head, weight=_zero3_partition((V, H)))


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_zero3_partition_put_in_a_checked_call_is_refused_naming_the_fix(name):
    """A call checked on stand-ins (the HF path, before the backbone), the real parameters put
    in with the hidden states: a weight or bias still partitioned is the same ValueError, not
    an IndexError from its [0] shape."""
    from logitless.contract.head import check_head_call, with_hidden
    from logitless.contract.options import HeadOptions

    args, options = _good(bias=torch.randn(V)), HeadOptions()
    call = check_head_call(args["hidden"], args["weight"], args["labels"], args["bias"], options)
    shape = (V, H) if name == "weight" else (V,)
    call = call.replace(**{name: _zero3_partition(shape)})
    with pytest.raises(ValueError, match=f"{name} is a DeepSpeed ZeRO-3 parameter that is not"):
        with_hidden(call, args["hidden"], options)
