"""The vision networks: the handbook's parameter count, shapes, box decoding and losses."""

import pytest
import torch

from engine.models.vision import (
    GridDetector,
    SmallCNN,
    TinyUNet,
    decode_boxes,
    detection_loss,
    segmentation_loss,
    soft_dice_loss,
)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_detector_has_the_handbooks_28709_parameters():
    assert n_params(GridDetector()) == 28_709
    logit, boxes = GridDetector()(torch.rand(2, 3, 96, 96))
    assert logit.shape == (2,) and boxes.shape == (2, 4)


def test_decoded_boxes_are_ordered_and_in_range():
    boxes = decode_boxes(torch.randn(100, 4) * 5)
    assert (boxes >= 0).all() and (boxes <= 1).all()
    assert (boxes[:, 2] >= boxes[:, 0]).all() and (boxes[:, 3] >= boxes[:, 1]).all()


def test_box_loss_ignores_empty_images():
    raw = torch.zeros(2, 4, requires_grad=True)
    boxes = decode_boxes(raw)
    loss = detection_loss(torch.zeros(2), boxes, torch.tensor([1, 0]),
                          torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.0, 0.0, 0.0, 0.0]]))
    loss.backward()
    assert raw.grad[0].abs().sum() > 0 and raw.grad[1].abs().sum() == 0
    # BCE(0 logit) = ln 2 for both; smooth-L1 on positives: box (0.5,0.5,0.5,0.5) vs target.
    diffs = torch.tensor([0.4, 0.4, 0.1, 0.1])
    smooth_l1 = torch.where(diffs < 1, 0.5 * diffs ** 2, diffs - 0.5).mean()
    assert loss.item() == pytest.approx(float(torch.log(torch.tensor(2.0)) + 5 * smooth_l1))


def test_soft_dice_by_hand():
    prob = torch.tensor([[[0.5, 0.5], [0.0, 1.0]]])
    target = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    # Dice = (2·1.5 + 1) / (2 + 2 + 1) = 0.8
    assert float(soft_dice_loss(prob, target)) == pytest.approx(0.2)


def test_tiny_unet_keeps_odd_sizes():
    out = TinyUNet(8)(torch.rand(1, 3, 30, 34))
    assert out.shape == (1, 1, 30, 34)


def test_classifier_overfits_eight_examples():
    """The handbook's bug check: the machinery can fit a handful of clean examples."""
    torch.manual_seed(0)
    x, y = torch.rand(8, 3, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    model = SmallCNN(3)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (model(x).argmax(1) == y).all()


def test_segmentation_loss_rewards_the_right_mask():
    target = torch.zeros(1, 1, 8, 8)
    target[..., 2:6, 2:6] = 1
    good, empty = (target * 2 - 1) * 6, torch.full_like(target, -6.0)
    assert segmentation_loss(good, target) < 0.1 < segmentation_loss(empty, target)
