"""Writes the PyTorch-exported ONNX models beside this script, with inputs and PyTorch's outputs (run once, by
hand; the test suite reads the files and never imports torch):

    pip install torch==2.13.0 onnxscript && python tests/data/onnx/make_torch_models.py

- torch_resnet.onnx: a small ResNet-style network (convolution, BatchNorm, ReLU, a residual sum, max pooling,
  global average pooling, a linear classifier), in inference mode;
- torch_lstm_text.onnx: an Embedding + batch-first LSTM text classifier reading the last step;
- torch_birnn_tagger.onnx: a time-major (batch_first=False) bidirectional LSTM, then a bidirectional GRU, and a
  linear layer scoring every step: x [T, N, 6] -> y [T, N, 5];
- torch_bilstm_text.onnx: a batch-first bidirectional LSTM of two layers reading its last step, exported at batch
  2 with a symbolic batch axis, its inputs and outputs at batch 4;
- torch_stacked_hn.onnx: an LSTM of two layers and a GRU of two layers side by side, classifying from each one's
  last layer's final state h_n[-1] (the pattern most PyTorch text classifiers use), batch symbolic, run at batch 5;
- torch_gelu_mlp.onnx: Linear layers with GELU between them, exact (written below opset 20 as its erf formula,
  x/sqrt(2) -> Erf -> +1 -> *x -> *0.5) and tanh-approximated, the first one's input also added to its output.
Each NAME.onnx has NAME.npz beside it with x (the input) and y (PyTorch's output).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.block1, self.block2 = Block(8), Block(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class TextLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.fc = nn.Linear(12, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.emb(ids))
        return torch.log_softmax(self.fc(y[:, -1]), dim=1)


class BiRNNTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 7, bidirectional=True)
        self.gru = nn.GRU(14, 4, bidirectional=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        y, _ = self.gru(y)
        return self.fc(y)


def _randomize_statistics(model: nn.Module, gen: torch.Generator) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)


class BiLSTMText(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 7, num_layers=2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(14, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return self.fc(y[:, -1])


class StackedFinalState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 9, num_layers=2, batch_first=True)
        self.gru = nn.GRU(6, 5, num_layers=2, batch_first=True)
        self.fc = nn.Linear(14, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(x)
        _, g = self.gru(x)
        return self.fc(torch.cat([h[-1], g[-1]], dim=1))


class GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = nn.functional.gelu(h) + h
        return self.fc3(nn.functional.gelu(self.fc2(h), approximate="tanh"))


def write(name: str, model: nn.Module, x: torch.Tensor, exported_with: torch.Tensor | None = None) -> None:
    """``exported_with``: another input to export at, the batch axis left symbolic (x then runs at its own)."""
    model.eval()
    with torch.no_grad():
        y = model(x)
    dynamic = {"dynamic_axes": {"x": {0: "N"}, "y": {0: "N"}}} if exported_with is not None else {}
    torch.onnx.export(model, (x if exported_with is None else exported_with,), str(HERE / f"{name}.onnx"),
                      input_names=["x"], output_names=["y"], dynamo=False, opset_version=17, **dynamic)
    np.savez(HERE / f"{name}.npz", x=x.numpy(), y=y.numpy())


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    resnet = ResNet()
    with torch.no_grad():
        _randomize_statistics(resnet, gen)
    write("torch_resnet", resnet, torch.randn(2, 3, 16, 16, generator=gen))
    write("torch_lstm_text", TextLSTM(), torch.randint(0, 50, (3, 7), generator=gen))
    write_tagger()
    write_bilstm_text()
    write_gelu_mlp()
    write_stacked_final_state()


def write_stacked_final_state() -> None:
    """Its own seeds, so it can be written alone."""
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(8)
    write("torch_stacked_hn", StackedFinalState(), torch.randn(5, 4, 6, generator=gen),
          exported_with=torch.randn(2, 4, 6, generator=gen))


def write_gelu_mlp() -> None:
    """Its own seeds, so it can be written alone."""
    torch.manual_seed(5)
    write("torch_gelu_mlp", GeluMLP(), torch.randn(3, 6, generator=torch.Generator().manual_seed(6)) * 2)


def write_bilstm_text() -> None:
    """Its own seeds, so it can be written alone."""
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(4)
    write("torch_bilstm_text", BiLSTMText(), torch.randn(4, 6, 5, generator=gen),
          exported_with=torch.randn(2, 6, 5, generator=gen))


def write_tagger() -> None:
    """Its own seeds, so it can be written alone: python -c "import make_torch_models as m; m.write_tagger()"."""
    torch.manual_seed(1)
    write("torch_birnn_tagger", BiRNNTagger(), torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(2)))


if __name__ == "__main__":
    main()
