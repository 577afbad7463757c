"""DSpark's Markov and confidence heads: vLLM's parameter names and shapes, the zero-bias start, hand-checked maths."""

import pytest
import torch

from draftsmith.drafters.dspark.heads import ConfidenceHead, MarkovHead

pytestmark = pytest.mark.unit


def test_markov_names_and_shapes_match_vllm():
    head = MarkovHead(vocab_size=10, out_vocab_size=6, rank=3)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    # vLLM: markov_w1 = Embedding(vocab_size, r); markov_w2 = ParallelLMHead(draft_vocab_size, r) -> weight [Vd, r].
    assert shapes == {"markov_w1.weight": (10, 3), "markov_w2.weight": (6, 3)}


def test_markov_bias_starts_at_zero_but_can_learn():
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=10, out_vocab_size=6, rank=3)
    prev = torch.tensor([[1, 4], [7, 9]])
    bias = head.bias(prev)
    assert bias.shape == (2, 2, 6)
    assert torch.count_nonzero(bias) == 0
    # With w1 random and w2 zero, the first step moves w2 (w1 moves from the second step on).
    (bias * torch.randn_like(bias)).sum().backward()
    w1, w2 = head.markov_w1.weight.grad, head.markov_w2.weight.grad
    assert w1 is not None and w2 is not None
    assert torch.count_nonzero(w2) > 0
    assert torch.count_nonzero(w1) == 0


def test_markov_bias_is_w2_times_w1_row():
    head = MarkovHead(vocab_size=3, out_vocab_size=2, rank=2)
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, -1.0]]))
        head.markov_w2.weight.copy_(torch.tensor([[3.0, 1.0], [0.5, -2.0]]))
    # prev = 2: W1[2] = [1, -1]; bias = W2 @ [1, -1] = [3 - 1, 0.5 + 2] = [2, 2.5].
    assert head.bias(torch.tensor([2])).tolist() == [[2.0, 2.5]]
    # prev = 1: W1[1] = [0, 2]; bias = [2, -4].
    assert head.project(head.embed(torch.tensor(1))).tolist() == [2.0, -4.0]


def test_confidence_with_markov_hand_checked():
    head = ConfidenceHead(hidden_size=2, markov_rank=1, with_markov=True)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == {"proj.weight": (1, 3), "proj.bias": (1,)}
    with torch.no_grad():
        head.proj.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]))
        head.proj.bias.fill_(0.25)
    # [h; emb] = [1, 2, 3]: 0.5 - 2 + 6 + 0.25 = 4.75.
    out = head(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]]))
    assert out.shape == (1,)
    assert float(out[0].detach()) == pytest.approx(4.75)


def test_confidence_without_markov_ignores_the_embedding():
    head = ConfidenceHead(hidden_size=2, markov_rank=5, with_markov=False)
    assert tuple(head.proj.weight.shape) == (1, 2)
    h = torch.randn(4, 3, 2)
    a = head(h, torch.zeros(4, 3, 5))
    b = head(h, torch.randn(4, 3, 5))
    assert a.shape == (4, 3)
    assert torch.equal(a, b)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="rank"):
        MarkovHead(vocab_size=10, out_vocab_size=6, rank=0)
