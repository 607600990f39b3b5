"""Two workers' gradients for one micro-batch, compared as a stage compares second opinions."""

import math

import torch

from hetnode.training.gradient_checks import agreement, norm_ratio


def test_a_flipped_or_scaled_gradient_shows_against_the_honest_one():
    g = torch.randn(4, 8, 15).to(torch.bfloat16)
    near = (g.float() + 0.1 * torch.randn_like(g.float())).to(torch.bfloat16)
    assert agreement(g, near) > 0.9 and norm_ratio(g, near) < 1.1
    assert agreement(g, -g) < -0.99 and math.isclose(norm_ratio(g, -g), 1.0)
    assert math.isclose(norm_ratio(g, g * 1000), 1000.0, rel_tol=0.01) and agreement(g, g * 1000) > 0.99


def test_a_gradient_with_no_norm_agrees_with_nothing():
    g = torch.randn(4, 8, 15)
    assert agreement(g, torch.zeros_like(g)) == -1.0 and norm_ratio(g, torch.zeros_like(g)) == math.inf
    assert agreement(g, torch.full_like(g, math.inf)) == -1.0
