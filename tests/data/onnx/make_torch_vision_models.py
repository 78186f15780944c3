"""Writes PyTorch-exported vision models beside this script, as make_torch_models.py does (run once, by hand):

    pip install torch==2.13.0 && python tests/data/onnx/make_torch_vision_models.py

- torch_mobilenet.onnx: MobileNet-v2's building blocks at a small size: a strided stem, inverted residual blocks
  (1x1 expansion, 3x3 depthwise convolution, 1x1 projection, BatchNorm, ReLU6 — exported as Clip — and the
  residual sum), a 1x1 head, global average pooling and a linear classifier;
- torch_window_settings.onnx: the window settings users meet in PyTorch models: a dilated convolution with
  asymmetric padding, a transposed convolution with output padding, max and average pooling with ceil_mode (the
  average without the padding counted), Hardtanh, and a grouped convolution.
"""

from __future__ import annotations

import torch
from make_torch_models import _randomize_statistics, write
from torch import nn


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, relu6: bool = True) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU6()) if relu6 else nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(conv_bn(cin, hidden, 1), conv_bn(hidden, hidden, 3, stride, groups=hidden),
                                  conv_bn(hidden, cout, 1, relu6=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 8, 3, 2), InvertedResidual(8, 8, 1, 1),
                                      InvertedResidual(8, 12, 2, 4), InvertedResidual(12, 12, 1, 4),
                                      InvertedResidual(12, 16, 2, 4), conv_bn(16, 32, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class WindowSettings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dilated = nn.Conv2d(3, 6, 3, padding=(2, 1), dilation=(2, 1))
        self.grouped = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=3)
        self.up = nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1)
        self.max = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.avg = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.act = nn.Hardtanh()
        self.fc = nn.Linear(4 * 5 * 5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.dilated(x))
        x = torch.relu(self.grouped(x))
        x = self.max(self.up(x))
        return self.fc(torch.flatten(self.avg(x), 1))


def main() -> None:
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    mobilenet = MobileNet()
    with torch.no_grad():
        _randomize_statistics(mobilenet, gen)
    write("torch_mobilenet", mobilenet, torch.randn(2, 3, 32, 32, generator=gen))
    write("torch_window_settings", WindowSettings(), torch.randn(2, 3, 15, 15, generator=gen))


if __name__ == "__main__":
    main()
