"""Every head option an HF entry point takes reaches the op it runs.

``causal_lm_divergence(..., batch_invariant=True)`` used to stop at the HF layer: the option
was picked, checked and dropped before :func:`logitless.linear_divergence`, so the call ran in
the default mode (tests/test_hf_invariance.py's shapes happen to give the same bits either
way). A spy on the op sees what it is called with.
"""

from __future__ import annotations

import pytest
import torch

from logitless.integrations import hf

transformers = pytest.importorskip("transformers")  # the [hf] extra: installed in CI


def _model(width: int):
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=width, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(width)
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("invariant", [False, True])
def test_divergence_passes_batch_invariant_to_the_op(monkeypatch, invariant):
    from logitless.integrations import seam

    seen = []
    real = seam.divergence_of_call  # the op on the checked call the seam builds

    def spy(call):
        seen.append(call.student.batch_invariant)
        return real(call)

    monkeypatch.setattr(seam, "divergence_of_call", spy)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf.causal_lm_divergence(_model(16), _model(32), ids, beta=0.5, batch_invariant=invariant)
    assert seen == [invariant]
