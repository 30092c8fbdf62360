"""A small anchor-free YOLO-style detector with the YOLOv8 output layout.

Output: [B, 4 + C, N] with (cx, cy, w, h) in input pixels and per-class
sigmoid scores, N = cells of the stride-8, 16 and 32 maps. The decode is part
of forward(), as in exported YOLOv8 models, so a TorchScript export is served
by the same post-processing as any user's export.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

STRIDES = (8, 16, 32)


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.bn(self.conv(x)))


class Stage(nn.Module):
    """Downsample by 2, then a residual refinement."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.down = ConvBlock(c_in, c_out, 2)
        self.refine = ConvBlock(c_out, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(x)
        return x + self.refine(x)


class PooledContext(nn.Module):
    """SPPF-style: max-pools of growing reach, so the coarse map sees whole objects."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.mix = nn.Conv2d(4 * channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.pool(x)
        b = self.pool(a)
        c = self.pool(b)
        return x + F.silu(self.mix(torch.cat([x, a, b, c], dim=1)))


class TinyYolo(nn.Module):
    """Backbone, pooled context on the coarsest map, a top-down path (FPN) so the
    fine maps get the coarse map's semantics, and a conv + 1x1 head per level."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.num_classes = num_classes
        w = width
        self.stem = ConvBlock(3, w, 2)  # /2
        self.stage2 = Stage(w, 2 * w)  # /4
        self.stage3 = Stage(2 * w, 4 * w)  # /8
        self.stage4 = Stage(4 * w, 8 * w)  # /16
        self.stage5 = Stage(8 * w, 8 * w)  # /32
        self.context = PooledContext(8 * w)
        self.lateral4 = nn.Conv2d(8 * w, 8 * w, 1)
        self.lateral3 = nn.Conv2d(8 * w, 4 * w, 1)
        channels = (4 * w, 8 * w, 8 * w)
        self.necks = nn.ModuleList([ConvBlock(c, c) for c in channels])
        self.heads = nn.ModuleList([nn.Conv2d(c, 4 + num_classes, 1) for c in channels])
        self.strides: list[int] = list(STRIDES)

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.stage2(self.stem(x))
        p3 = self.stage3(x)
        p4 = self.stage4(p3)
        p5 = self.context(self.stage5(p4))
        p4 = p4 + self.lateral4(F.interpolate(p5, size=p4.shape[-2:], mode="nearest"))
        p3 = p3 + self.lateral3(F.interpolate(p4, size=p3.shape[-2:], mode="nearest"))
        return [p3, p4, p5]

    def raw_outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per level [B, 4 + C, H, W]: box distances (pre-softplus) and class logits."""
        outputs: list[torch.Tensor] = []
        feats = self.features(x)
        for i, (neck, head) in enumerate(zip(self.necks, self.heads)):
            outputs.append(head(neck(feats[i])))
        return outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decode_outputs(self.raw_outputs(x), self.strides)


def cell_centres(height: int, width: int, stride: int, device: torch.device) -> torch.Tensor:
    """[H*W, 2] cell centres (x, y) in input pixels, row-major like flatten()."""
    ys = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) * stride
    xs = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) * stride
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x.reshape(-1), grid_y.reshape(-1)], dim=1)


def decode_outputs(raw: list[torch.Tensor], strides: list[int]) -> torch.Tensor:
    decoded: list[torch.Tensor] = []
    for level, out in enumerate(raw):
        batch, channels, height, width = out.shape
        stride = strides[level]
        flat = out.reshape(batch, channels, height * width)
        centres = cell_centres(height, width, stride, out.device).t().unsqueeze(0)  # [1, 2, HW]
        dist = F.softplus(flat[:, :4]) * stride  # l, t, r, b
        x1y1 = centres - dist[:, :2]
        x2y2 = centres + dist[:, 2:4]
        cxcy = (x1y1 + x2y2) / 2
        wh = x2y2 - x1y1
        scores = torch.sigmoid(flat[:, 4:])
        decoded.append(torch.cat([cxcy, wh, scores], dim=1))
    return torch.cat(decoded, dim=2)


def build_random(num_classes: int, seed: int = 0) -> TinyYolo:
    """The untrained default: seeded, so every worker serves the same answers."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = TinyYolo(num_classes)
    torch.random.set_rng_state(generator_state)
    return model.eval()
