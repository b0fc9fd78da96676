"""Packed-sequence helpers: hand-worked cases, hypothesis properties, and every ValueError.

The reference below is deliberately a plain Python loop over documents: obviously right, and
sharing no code with the vectorized implementation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from logitless.packing import (
    cu_seqlens_to_document_ids,
    cu_seqlens_to_position_ids,
    document_ids_to_cu_seqlens,
    next_token_labels,
    position_ids_to_cu_seqlens,
    position_ids_to_document_ids,
    segment_sum,
)

IGN = -100
SETTINGS = settings(
    max_examples=75,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def t(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def ref_labels(tokens: list[int], lengths: list[int], ignore_index: int = IGN) -> list[int]:
    """Labels of a flat stream holding documents of ``lengths`` then padding."""
    labels = [ignore_index] * len(tokens)
    start = 0
    for n in lengths:
        for i in range(start, start + n - 1):
            labels[i] = tokens[i + 1]
        start += n
    return labels


def cumsum0(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# ------------------------------------------------------------------------------------------
# hand-worked examples


def test_labels_cu_seqlens_with_tail_padding():
    ids = t([11, 12, 13, 21, 22, 31, 0, 0])
    labels = next_token_labels(ids, cu_seqlens=t([0, 3, 5, 6]))
    assert_close(labels, t([12, 13, IGN, 22, IGN, IGN, IGN, IGN]))
    assert labels.dtype == torch.long


def test_labels_do_not_cross_document_boundary_seed_000():
    # naive shift would label 13 -> 21 and 22 -> 31 (seed 000's bug)
    ids = t([11, 12, 13, 21, 22, 31])
    labels = next_token_labels(ids, cu_seqlens=t([0, 3, 5, 6], torch.int32))
    assert 21 not in labels[:3].tolist()
    assert_close(labels, t([12, 13, IGN, 22, IGN, IGN]))


def test_labels_plain_rows_and_flat():
    assert_close(next_token_labels(t([1, 2, 3])), t([2, 3, IGN]))
    assert_close(next_token_labels(t([[1, 2, 3], [4, 5, 6]])), t([[2, 3, IGN], [5, 6, IGN]]))


def test_labels_position_ids_rows_with_left_and_right_padding():
    ids = t([[1, 2, 3, 4, 5], [9, 9, 6, 7, 8]])
    pos = t([[0, 1, 0, 1, -1], [-1, -1, 0, 1, 2]])
    labels = next_token_labels(ids, position_ids=pos, ignore_index=-1)
    assert_close(labels, t([[2, -1, 4, -1, -1], [-1, -1, 7, 8, -1]]))


def test_labels_position_ids_from_attention_mask_recipe():
    mask = t([[1, 1, 1, 0], [0, 1, 1, 1]])
    pos = torch.where(mask.bool(), mask.cumsum(-1) - 1, -1)
    assert_close(pos, t([[0, 1, 2, -1], [-1, 0, 1, 2]]))
    labels = next_token_labels(t([[1, 2, 3, 0], [0, 4, 5, 6]]), position_ids=pos)
    assert_close(labels, t([[2, 3, IGN, IGN], [IGN, 5, 6, IGN]]))


def test_labels_document_ids_with_interior_padding():
    ids = t([1, 2, 0, 3, 4, 5])
    doc = t([0, 0, -1, 1, 1, 1])
    assert_close(next_token_labels(ids, document_ids=doc), t([2, IGN, IGN, 4, 5, IGN]))


def test_labels_cu_seqlens_on_rows_reads_the_flattened_stream():
    ids = t([[1, 2, 3], [4, 5, 6]])
    labels = next_token_labels(ids, cu_seqlens=t([0, 4, 5]))
    # document 0 runs on into row 1; token 6 is padding
    assert_close(labels, t([[2, 3, 4], [IGN, IGN, IGN]]))


def test_labels_empty_and_single_token():
    assert next_token_labels(t([])).shape == (0,)
    assert next_token_labels(t([]), cu_seqlens=t([0])).shape == (0,)
    assert_close(next_token_labels(t([7])), t([IGN]))
    assert next_token_labels(torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)


def test_labels_keep_uint8_and_int32_token_values():
    ids = t([200, 201, 202], torch.uint8)
    assert_close(next_token_labels(ids), t([201, 202, IGN]))
    assert_close(next_token_labels(ids.int()), t([201, 202, IGN]))


def test_cu_seqlens_to_document_ids_hand():
    assert_close(cu_seqlens_to_document_ids(t([0, 3, 5]), total=7), t([0, 0, 0, 1, 1, -1, -1]))
    assert_close(cu_seqlens_to_document_ids(t([0, 3, 5], torch.int32)), t([0, 0, 0, 1, 1]))
    # zero-length documents keep their index; nothing gets an index past the last document
    assert_close(cu_seqlens_to_document_ids(t([0, 0, 2, 2, 3]), total=4), t([1, 1, 3, -1]))
    assert_close(cu_seqlens_to_document_ids(t([0]), total=2), t([-1, -1]))


def test_padding_never_gets_a_phantom_document_index_seed_004():
    cu = t([0, 2, 5])
    doc = cu_seqlens_to_document_ids(cu, total=9)
    assert doc.max().item() == len(cu) - 2
    assert (doc[5:] == -1).all()
    # a per-document buffer of num_documents entries is enough (seed 004 crashed here)
    assert_close(segment_sum(torch.ones(9), doc, num_documents=2), torch.tensor([2.0, 3.0]))


def test_cu_seqlens_to_position_ids_hand():
    assert_close(cu_seqlens_to_position_ids(t([0, 3, 5]), total=6), t([0, 1, 2, 0, 1, -1]))
    assert_close(cu_seqlens_to_position_ids(t([0, 0, 2])), t([0, 1]))


def test_position_ids_to_document_ids_hand():
    pos = t([[0, 1, 2, 0, 1], [0, 1, -1, -1, -1], [-1, 0, 0, 1, -1]])
    expected = t([[0, 0, 0, 1, 1], [2, 2, -1, -1, -1], [-1, 3, 4, 4, -1]])
    assert_close(position_ids_to_document_ids(pos), expected)
    assert_close(position_ids_to_document_ids(t([0, 0, 0], torch.int32)), t([0, 1, 2]))


def test_position_ids_to_cu_seqlens_hand():
    out = position_ids_to_cu_seqlens(t([0, 1, 2, 0, 1, 0, -1]))
    assert_close(out, t([0, 3, 5, 6], torch.int32))
    out = position_ids_to_cu_seqlens(t([[0, 1, 0], [0, 1, 2]]), dtype=torch.int64)
    assert_close(out, t([0, 2, 3, 6]))
    assert_close(position_ids_to_cu_seqlens(t([-1, -1])), t([0], torch.int32))


def test_document_ids_to_cu_seqlens_hand():
    assert_close(document_ids_to_cu_seqlens(t([0, 0, 0, 1, 1, -1])), t([0, 3, 5], torch.int32))
    # gaps and num_documents give zero-length documents
    out = document_ids_to_cu_seqlens(t([1, 1, 3]), num_documents=5, dtype=torch.int64)
    assert_close(out, t([0, 0, 2, 2, 3, 3]))
    assert_close(document_ids_to_cu_seqlens(t([], torch.long)), t([0], torch.int32))


def test_segment_sum_hand_and_grad():
    values = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]], requires_grad=True)
    doc = t([0, 0, -1, 2])
    out = segment_sum(values, doc, 3)
    assert_close(out, torch.tensor([[3.0, 30.0], [0.0, 0.0], [4.0, 40.0]]))
    out.backward(torch.tensor([[1.0, 2.0], [5.0, 6.0], [3.0, 4.0]]))
    assert_close(values.grad, torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]))
    # [B, T] ids, per-token values
    out = segment_sum(torch.ones(2, 3), t([[0, 0, -1], [1, 1, 1]]), 2)
    assert_close(out, torch.tensor([2.0, 3.0]))
    assert segment_sum(torch.ones(0), t([]), 0).shape == (0,)


# ------------------------------------------------------------------------------------------
# properties

# a packing: document lengths (zero-length allowed where the form can express it) + padding
lengths_st = st.lists(st.integers(0, 7), min_size=0, max_size=6)
padding_st = st.integers(0, 5)


def _stream(draw, lengths, padding):
    n = sum(lengths) + padding
    return draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))


@SETTINGS
@given(st.data(), lengths_st, padding_st)
def test_prop_labels_from_cu_seqlens_match_reference(data, lengths, padding):
    tokens = _stream(data.draw, lengths, padding)
    cu = t(cumsum0(lengths), data.draw(st.sampled_from([torch.int32, torch.int64])))
    labels = next_token_labels(t(tokens), cu_seqlens=cu)
    assert labels.tolist() == ref_labels(tokens, lengths)

    doc = cu_seqlens_to_document_ids(cu, total=len(tokens))
    # never a label across a document boundary: a kept label is the next token of the same doc
    keep = labels != IGN
    idx = keep.nonzero().squeeze(1)
    assert (doc[idx] == doc[idx + 1]).all() and (doc[idx] >= 0).all()
    # padding gets ignore_index and document id -1, and nothing past the last document
    pad = slice(sum(lengths), None)
    assert (labels[pad] == IGN).all() and (doc[pad] == -1).all()
    assert doc.max().item() < len(lengths) if len(tokens) else True
    # every form of the same packing gives the same labels
    same = next_token_labels(t(tokens), document_ids=doc)
    assert_close(same, labels)
    if all(n > 0 for n in lengths):
        pos = cu_seqlens_to_position_ids(cu, total=len(tokens))
        assert_close(next_token_labels(t(tokens), position_ids=pos), labels)


@SETTINGS
@given(lengths_st, padding_st)
def test_prop_round_trips(lengths, padding):
    cu = t(cumsum0(lengths))
    total = sum(lengths) + padding
    doc = cu_seqlens_to_document_ids(cu, total=total)
    assert doc.dtype == torch.long and doc.shape == (total,)
    back = document_ids_to_cu_seqlens(doc, num_documents=len(lengths), dtype=torch.int64)
    assert_close(back, cu)
    assert_close(cu_seqlens_to_document_ids(back, total=total), doc)

    pos = cu_seqlens_to_position_ids(cu, total=total)
    nonempty = t(cumsum0([n for n in lengths if n > 0]))
    assert_close(position_ids_to_cu_seqlens(pos, dtype=torch.int64), nonempty)
    # position ids number the non-empty documents in order
    assert_close(position_ids_to_document_ids(pos), cu_seqlens_to_document_ids(nonempty, total))
    real = doc >= 0
    assert ((pos >= 0) == real).all()


# a [B, T] batch: each row holds documents of positive length, padding anywhere between them
row_st = st.lists(
    st.tuples(st.sampled_from(["doc", "pad"]), st.integers(1, 5)), min_size=0, max_size=4
)


@SETTINGS
@given(st.data(), st.lists(row_st, min_size=1, max_size=4))
def test_prop_rows_and_flat_forms_agree(data, rows):
    width = max([sum(n for _, n in row) for row in rows] + [1])
    pos_rows, tok_rows, expected = [], [], []
    for row in rows:
        pos = []
        for kind, n in row:
            pos += list(range(n)) if kind == "doc" else [-1] * n
        pos += [-1] * (width - len(pos))  # right padding
        tokens = data.draw(st.lists(st.integers(0, 99), min_size=width, max_size=width))
        # reference, row by row: a run of positions 0..n-1 is one document
        lab = [IGN] * width
        for i in range(width - 1):
            if pos[i] >= 0 and pos[i + 1] == pos[i] + 1:
                lab[i] = tokens[i + 1]
        pos_rows.append(pos)
        tok_rows.append(tokens)
        expected.append(lab)
    ids, pos = t(tok_rows), t(pos_rows)
    labels = next_token_labels(ids, position_ids=pos)
    assert labels.tolist() == expected

    # the flattened stream, described by document ids, gives the same labels
    doc = position_ids_to_document_ids(pos)
    flat = next_token_labels(ids.reshape(-1), document_ids=doc.reshape(-1))
    assert_close(flat.reshape(ids.shape), labels)
    assert_close(next_token_labels(ids, document_ids=doc), labels)
    assert ((doc == -1) == (pos < 0)).all()
    assert (labels[pos < 0] == IGN).all()
    # documents are numbered 0..D-1 with no gap, in row-major order
    real = doc[doc >= 0]
    assert real.tolist() == sorted(real.tolist())
    assert set(real.tolist()) == set(range(int((pos == 0).sum())))

    # a row without padding is one document: the plain [B, T] form agrees with cu_seqlens
    b = len(rows)
    plain = next_token_labels(ids)
    cu = t(list(range(0, b * width + 1, width)))
    assert_close(plain.reshape(-1), next_token_labels(ids.reshape(-1), cu_seqlens=cu))


@SETTINGS
@given(st.data(), lengths_st, padding_st, st.integers(0, 3))
def test_prop_segment_sum_matches_loop(data, lengths, padding, extra):
    total = sum(lengths) + padding
    doc = cu_seqlens_to_document_ids(t(cumsum0(lengths)), total=total)
    shape = (total,) + ((extra,) if extra else ())
    values = torch.randn(shape, dtype=torch.float64)
    out = segment_sum(values, doc, len(lengths))
    assert out.shape == (len(lengths),) + shape[1:]
    for d in range(len(lengths)):
        assert_close(out[d], values[doc == d].sum(0))
    # padding contributes nothing: the sums add up to the real tokens' total
    assert_close(out.sum(0), values[doc >= 0].sum(0))


# ------------------------------------------------------------------------------------------
# bad input: a ValueError naming the argument, before any work

BAD_CU = [
    (t([1, 3, 5]), "must start with 0"),
    (t([0, 4, 3]), "non-decreasing"),
    (t([0, 3, 9]), r"cu_seqlens\[-1\] must be <= the number of tokens 6"),
    (t([0.0, 3.0], torch.float32), "dtype torch.int32 or torch.int64"),
    (t([0, 3], torch.int16), "dtype torch.int32 or torch.int64"),
    (t([[0, 3]]), "1-D tensor"),
    (t([], torch.long), "1-D tensor"),
    ([0, 3], "must be a torch.Tensor"),
]


@pytest.mark.parametrize(("cu", "match"), BAD_CU)
def test_bad_cu_seqlens_in_labels(cu, match):
    with pytest.raises(ValueError, match=match) as info:
        next_token_labels(t([1, 2, 3, 4, 5, 6]), cu_seqlens=cu)
    assert "cu_seqlens" in str(info.value)


@pytest.mark.parametrize(("cu", "match"), [c for c in BAD_CU if "number of tokens" not in c[1]])
def test_bad_cu_seqlens_in_converters(cu, match):
    for fn in (cu_seqlens_to_document_ids, cu_seqlens_to_position_ids):
        with pytest.raises(ValueError, match=match):
            fn(cu)


def test_bad_total():
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be <= the number of tokens 4"):
        cu_seqlens_to_document_ids(t([0, 5]), total=4)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="total must be an int >= 0"):
            cu_seqlens_to_position_ids(t([0, 1]), total=bad)


def test_bad_labels_arguments():
    ids = t([1, 2, 3, 4])
    with pytest.raises(ValueError, match="at most one of .* got cu_seqlens, position_ids"):
        next_token_labels(ids, cu_seqlens=t([0, 4]), position_ids=t([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"got position_ids, document_ids"):
        next_token_labels(ids, position_ids=t([0, 1, 2, 3]), document_ids=t([0, 0, 0, 0]))
    with pytest.raises(
        ValueError, match=r"position_ids must have input_ids' shape \[4\], got \[2, 2\]"
    ):
        next_token_labels(ids, position_ids=t([[0, 1], [0, 1]]))
    with pytest.raises(
        ValueError, match=r"document_ids must have input_ids' shape \[4\], got \[3\]"
    ):
        next_token_labels(ids, document_ids=t([0, 0, 0]))
    with pytest.raises(ValueError, match="position_ids must have an integer dtype"):
        next_token_labels(ids, position_ids=torch.zeros(4))
    with pytest.raises(
        ValueError, match=r"input_ids must have shape \[N\] or \[B, T\], got shape \[1, 1, 4\]"
    ):
        next_token_labels(ids[None, None])
    with pytest.raises(ValueError, match="input_ids must have an integer dtype"):
        next_token_labels(ids.float())
    with pytest.raises(ValueError, match="input_ids must be a torch.Tensor, got list"):
        next_token_labels([1, 2, 3])
    with pytest.raises(ValueError, match="ignore_index must be an int"):
        next_token_labels(ids, ignore_index=-100.0)
    with pytest.raises(ValueError, match="ignore_index must be an int"):
        next_token_labels(ids, ignore_index=True)


def test_bad_device():
    ids = t([1, 2, 3, 4])
    with pytest.raises(ValueError, match="input_ids on cpu, cu_seqlens on meta"):
        next_token_labels(ids, cu_seqlens=torch.zeros(2, dtype=torch.long, device="meta"))


BAD_POSITIONS = [
    t([1, 2, 3]),  # a row must start with 0 or padding
    t([0, 1, 3]),  # a skipped position
    t([0, 1, -1, 2]),  # a document continuing across padding
    t([[0, 1, 2], [3, 4, 5]]),  # a document continuing across rows
    t([0, 0, 5]),
]


@pytest.mark.parametrize("pos", BAD_POSITIONS)
def test_bad_position_values(pos):
    for fn in (
        position_ids_to_document_ids,
        position_ids_to_cu_seqlens,
        lambda p: next_token_labels(torch.zeros_like(p), position_ids=p),
    ):
        with pytest.raises(ValueError, match="position_ids must restart at 0.*first at index"):
            fn(pos)


def test_bad_position_ids_form():
    with pytest.raises(ValueError, match="position_ids must have an integer dtype"):
        position_ids_to_document_ids(t([0, 1], torch.uint8))
    with pytest.raises(ValueError, match=r"position_ids must have shape \[N\] or \[B, T\]"):
        position_ids_to_document_ids(t(0))
    with pytest.raises(
        ValueError, match="position_ids: cu_seqlens can only express padding at the end"
    ):
        position_ids_to_cu_seqlens(t([[0, 1, -1], [0, 1, 2]]))
    with pytest.raises(ValueError, match="dtype must be torch.int32 or torch.int64"):
        position_ids_to_cu_seqlens(t([0, 1]), dtype=torch.float32)


def test_bad_document_ids():
    with pytest.raises(ValueError, match="padding at the end of the stream, got 1 padding"):
        document_ids_to_cu_seqlens(t([0, -1, 1]))
    with pytest.raises(ValueError, match="non-decreasing over real tokens"):
        document_ids_to_cu_seqlens(t([1, 1, 0]))
    with pytest.raises(ValueError, match="contiguous"):
        document_ids_to_cu_seqlens(t([0, 1, 0]))
    with pytest.raises(ValueError, match="contiguous"):
        next_token_labels(t([1, 2, 3, 4]), document_ids=t([0, 0, -1, 0]))
    with pytest.raises(ValueError, match=r"id\(s\) < -1, e.g. -2"):
        next_token_labels(t([1, 2]), document_ids=t([0, -2]))
    with pytest.raises(
        ValueError, match="num_documents must exceed every document id, got num_documents=2"
    ):
        document_ids_to_cu_seqlens(t([0, 2]), num_documents=2)
    with pytest.raises(ValueError, match="num_documents must be an int >= 0"):
        document_ids_to_cu_seqlens(t([0]), num_documents=-1)
    with pytest.raises(ValueError, match="dtype must be torch.int32 or torch.int64"):
        document_ids_to_cu_seqlens(t([0]), dtype=torch.int16)
    with pytest.raises(ValueError, match="document_ids must have an integer dtype"):
        document_ids_to_cu_seqlens(torch.zeros(2))


def test_bad_segment_sum():
    with pytest.raises(ValueError, match=r"document_ids must be in \[-1, 2\).*from -1 to 2"):
        segment_sum(torch.ones(3), t([0, -1, 2]), 2)
    with pytest.raises(ValueError, match=r"document_ids must be in \[-1, 2\).*from -3 to 0"):
        segment_sum(torch.ones(2), t([-3, 0]), 2)
    with pytest.raises(ValueError, match=r"values must have shape \[3, ...\].*got \[2\]"):
        segment_sum(torch.ones(2), t([0, 0, 0]), 1)
    with pytest.raises(ValueError, match="document_ids must be a signed integer tensor"):
        segment_sum(torch.ones(2), torch.zeros(2), 1)
    with pytest.raises(ValueError, match="num_documents must be an int >= 0"):
        segment_sum(torch.ones(2), t([0, 0]), 1.0)
    with pytest.raises(ValueError, match="values must be a torch.Tensor"):
        segment_sum([1.0], t([0]), 1)


# ------------------------------------------------------------------------------------------
# CUDA: same answers as CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    cu = t([0, 3, 3, 7, 8])
    ids = torch.randint(0, 50, (10,))
    pos = cu_seqlens_to_position_ids(cu, total=10)
    doc = cu_seqlens_to_document_ids(cu, total=10)
    dev = torch.device("cuda")
    assert_close(cu_seqlens_to_document_ids(cu.to(dev), total=10).cpu(), doc)
    assert_close(cu_seqlens_to_position_ids(cu.to(dev), total=10).cpu(), pos)
    assert_close(
        position_ids_to_document_ids(pos.to(dev)).cpu(), t([0, 0, 0, 1, 1, 1, 1, 2, -1, -1])
    )
    assert_close(position_ids_to_cu_seqlens(pos.to(dev)).cpu(), t([0, 3, 7, 8], torch.int32))
    assert_close(document_ids_to_cu_seqlens(doc.to(dev), 4).cpu(), cu.int())
    for kw in ({"cu_seqlens": cu}, {"position_ids": pos}, {"document_ids": doc}):
        dev_kw = {k: v.to(dev) for k, v in kw.items()}
        assert_close(next_token_labels(ids.to(dev), **dev_kw).cpu(), next_token_labels(ids, **kw))
    vals = torch.randn(10, 2)
    assert_close(segment_sum(vals.to(dev), doc.to(dev), 4).cpu(), segment_sum(vals, doc, 4))
