"""Tiny models for tests, importable as model.factory "toy_models:NAME"."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn


class TutorialNet(nn.Module):
    """The hooks tutorial's net: Conv2d(1, 2, 3) with kernels of 1s and 2s, zero bias, MaxPool2d(2, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.pool = nn.MaxPool2d(2, 2)
        with torch.no_grad():
            self.conv.weight[0].fill_(1.0)
            self.conv.weight[1].fill_(2.0)
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x[:, :1]))  # one input channel, as in the tutorial


def tutorial_net() -> nn.Module:
    return TutorialNet()


class TwoHeads(nn.Module):
    """A layer with a tuple output and one with a dict output."""

    def forward(self, x: torch.Tensor):
        return x.mean(dim=(2, 3)), x.amax(dim=(2, 3))


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor):
        return {"mean": x.mean(dim=(2, 3)), "min": x.amin(dim=(2, 3))}


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.heads = TwoHeads()
        self.dict = DictOut()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        a, b = self.heads(y)
        d = self.dict(y)
        return a + b + d["mean"]


def tuple_net() -> nn.Module:
    return TupleNet()


class InplaceNet(nn.Module):
    """conv -> ReLU(inplace=True): the conv's output tensor is overwritten after its hook ran."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.conv(x))).flatten(1)


def inplace_net() -> nn.Module:
    return InplaceNet()


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


class RaisingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.boom = Boom()
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.boom(self.conv(x)))


class SlowNet(nn.Module):
    """Sleeps in every forward, so that a test can interrupt a job midway."""

    def __init__(self, seconds: float = 0.15) -> None:
        super().__init__()
        self.seconds = seconds
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return self.pool(self.conv(x)).flatten(1)


def slow_net(seconds: float = 0.15) -> nn.Module:
    return SlowNet(seconds)


class GatedNet(SlowNet):
    """A SlowNet (same weights for the same seed) whose forward on an image waits while the file
    ``gate`` exists (at most two minutes): a test holds a job at its first batch until it lifts
    the gate. The forwards a worker makes to probe the model when it starts pass. With ``marker``,
    it writes that file when it first waits: the job is then running, its store made."""

    def __init__(self, gate: str, marker: str | None = None) -> None:
        super().__init__(0.0)
        self.gate, self.marker, self.calls = gate, marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os
        import time

        from extractor.compute.worker import PROBE_FORWARDS

        self.calls += 1
        if self.calls > PROBE_FORWARDS and self.marker and os.path.exists(self.gate):
            open(self.marker, "w").close()
        deadline = time.monotonic() + 120
        while self.calls > PROBE_FORWARDS and os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().forward(x)


def gated_net(gate: str, marker: str | None = None) -> nn.Module:
    return GatedNet(gate, marker)


def crash_on_read(name: str, seconds: float = 0.15) -> nn.Module:
    """A SlowNet in a process that dies, as from a crash inside a native decoder, when it reads
    the image file called ``name`` (Ray tests: it patches the worker's own process only)."""
    import os

    import extractor.data.decode as decode

    read = decode.read_printed

    def read_printed(item, *args, **kwargs):
        if isinstance(item, str) and os.path.basename(item) == name:
            os._exit(70)
        return read(item, *args, **kwargs)

    decode.read_printed = read_printed
    return SlowNet(seconds)


class FaultyDevice(SlowNet):
    """Raises what a CUDA fault raises (``torch.AcceleratorError``) in its forward number
    ``after + 1``, once: the marker file it then writes stops it in every later process."""

    def __init__(self, marker: str, after: int, seconds: float) -> None:
        super().__init__(seconds)
        self.marker, self.after, self.calls = marker, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        self.calls += 1
        if self.calls > self.after and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return super().forward(x)


def faulty_device(marker: str, after: int = 0, seconds: float = 0.15) -> nn.Module:
    return FaultyDevice(marker, after, seconds)


class WorkerBroken(BaseException):
    """Not an ``Exception``: escapes every per-image and per-shard handler, as an error of the
    worker as a whole does (neither a shard's nor the device's)."""


class BrokenWorker(FaultyDevice):
    """Raises :class:`WorkerBroken` in its forward number ``after + 1``: once (a marker file
    stops it in later processes), or in every process with ``once=False``."""

    def __init__(self, marker: str, after: int, seconds: float, once: bool) -> None:
        super().__init__(marker, after, seconds)
        self.once = once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        self.calls += 1
        if self.calls > self.after and not (self.once and os.path.exists(self.marker)):
            open(self.marker, "w").close()
            raise WorkerBroken("the worker's state is broken")
        return SlowNet.forward(self, x)


def broken_worker(marker: str, after: int = 0, seconds: float = 0.15, once: bool = True) -> nn.Module:
    return BrokenWorker(marker, after, seconds, once)


class CudaFault(nn.Module):
    """Indexes far out of bounds in its forward number ``after + 1``: on CUDA a real
    device-side assert, which leaves the process's CUDA context unusable (bench/gpu_check.py)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.calls = after, 0
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:  # before the captured layer: the forward stops after it
            far = torch.full((1,), 1 << 40, dtype=torch.long, device=x.device)
            x = x + 0 * x.flatten()[far].sum()  # on CUDA reported later, at a synchronisation
        return self.pool(self.conv(x)).flatten(1)


def cuda_fault(after: int = 0) -> nn.Module:
    return CudaFault(after)


class PickyNet(nn.Module):
    """Raises on any batch holding a saturated (white) pixel: a shard whose images always fail."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 2.2).any():
            raise ValueError("PickyNet cannot handle saturated pixels")
        return self.pool(self.conv(x)).flatten(1)


def picky_net() -> nn.Module:
    return PickyNet()


class Ident(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x**2


class SquareMean(nn.Module):
    """The gradient tutorial: x = [2, 2, 2, 2], y = x**2, z = mean(y); z is the one logit."""

    def __init__(self, double_grad: bool = False) -> None:
        super().__init__()
        self.ident = Ident()
        self.square = Square()
        self.double_grad = double_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ident(x[:, :1])  # (B, 1, 2, 2): four values per image
        y = self.square(x)
        if self.double_grad and y.requires_grad:
            y.register_hook(lambda g: g * 2)  # the tutorial's hook that doubles the gradient
        return y.flatten(1).mean(dim=1, keepdim=True)


def square_mean(double_grad: bool = False) -> nn.Module:
    return SquareMean(double_grad)


class InfConv(nn.Module):
    """A conv whose output turns to +Inf for white images (a model producing Inf for some rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        white = (x > 2.2).flatten(1).all(dim=1)
        return torch.where(white[:, None, None, None], torch.full_like(y, float("inf")), y)


class NanNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = InfConv()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


def nan_net() -> nn.Module:
    return NanNet()


class SmallCNN(nn.Module):
    """conv-bn-relu(inplace) stem, a second conv block, pooled linear head: a classifier small
    enough to compile in seconds."""

    def __init__(self, classes: int = 5, act: type[nn.Module] = nn.ReLU, gain: float = 1.0) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        with torch.no_grad():
            self.stem.weight.mul_(gain)  # gain 8: its layers reach above 6 on the probe's input, as a trained net's do
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), act())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.layer1(self.relu(self.bn(self.stem(x))))).flatten(1))


def small_cnn() -> nn.Module:
    return SmallCNN()


def small_cnn_gelu() -> nn.Module:
    """small_cnn's class and state dict (GELU has no parameters), another forward."""
    return SmallCNN(act=nn.GELU)


def every_relu(model: nn.Module, make: Callable[[], nn.Module]) -> nn.Module:
    """``model`` with each of its ReLUs replaced by ``make()``: the same class and state dict, another forward."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.ReLU:
                setattr(module, name, make())
    return model


def bright_cnn() -> nn.Module:
    """small_cnn whose layers reach above 6 on the probe's input (a ReLU6 for its ReLUs changes its values)."""
    return SmallCNN(gain=8.0)


def bright_cnn_leaky() -> nn.Module:
    """bright_cnn with every ReLU a LeakyReLU(0.01): its values move by about 1% (T5-15)."""
    return every_relu(bright_cnn(), lambda: nn.LeakyReLU(0.01))


def bright_cnn_relu6() -> nn.Module:
    """bright_cnn with every ReLU a ReLU6: its values move by 1-2% (T5-15)."""
    return every_relu(bright_cnn(), nn.ReLU6)


class FastPooled(nn.Module):
    """resnet50's capture shapes (layer3: 1024x14x14, avgpool: 2048x1x1) at almost no compute:
    measures the pipeline's own cost per image."""

    def __init__(self) -> None:
        super().__init__()
        self.layer3 = nn.Sequential(nn.AvgPool2d(16), nn.Conv2d(3, 1024, 1))
        self.avgpool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(1024, 2048, 1))
        self.fc = nn.Linear(2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.avgpool(self.layer3(x)).flatten(1))


def fast_pooled() -> nn.Module:
    return FastPooled()


class Reshape(nn.Module):
    """(B, 3, 16, 16) -> (B, 4, 4, 4)... of a 16x16 input only: neither its type nor another input size says
    which dims are the channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (16, 16):
            raise ValueError(f"this toy takes 16x16 inputs, not {tuple(x.shape[-2:])}")
        return x[:, :, :4, :].reshape(len(x), 4, 4, -1)[..., :4]


def fixed_size_map() -> nn.Module:
    return nn.Sequential(OrderedDict(block=Reshape(), pool=nn.Flatten()))


class Loud(nn.Module):
    """A conv whose outputs reach about 1e6: finite in float32, beyond float16's 65,504."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * 1e6


def loud_net() -> nn.Module:
    return nn.Sequential(OrderedDict(loud=Loud(), pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten()))


def paused_at(point: str, gate: str, marker: str, seconds: float = 0.0) -> nn.Module:
    """A SlowNet in a process whose job stops at ``point``: ``claim`` (it has looked at its store, and not
    yet made it: before its head's swap) or ``arrays`` (its generation swapped in, its claimant's record written,
    its arrays not yet).
    There it writes the file ``marker``, then waits while the file ``gate`` exists (at most two minutes):
    a test pauses a real job between two steps as a slow compile or a frozen VM would."""
    import os
    import time

    import extractor.store.layout as store
    import extractor.store.session as session

    owner, name = {"claim": (session, "swap_head"), "arrays": (store, "_create_arrays")}[point]
    original = getattr(owner, name)

    def paused(*args, **kwargs):
        open(marker, "w").close()
        deadline = time.monotonic() + 120
        while os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        return original(*args, **kwargs)

    setattr(owner, name, paused)
    return SlowNet(seconds)


def stopped_at_write(seconds: float = 0.0) -> nn.Module:
    """A SlowNet in a process that stops itself (SIGSTOP) at one change of a store, where the environment asks for it:
    ``EXTRACTOR_TEST_PAUSE`` = ``KEY|NTH|MARKER|inside-or-before`` (``helpers.pause.pause_at``), so that a job paused
    and one that is not (that finishes the store after it) run the same spec."""
    import os

    asked = os.environ.get("EXTRACTOR_TEST_PAUSE")
    if asked:
        from helpers.pause import pause_at

        key, nth, marker, where = asked.rsplit("|", 3)
        pause_at(key, int(nth), marker, where == "inside")
    return SlowNet(seconds)


class TinyResNet(nn.Module):
    """resnet18's module tree (conv1, bn1, relu, maxpool, layer1-4 of two torchvision BasicBlocks each,
    avgpool, fc) at widths 8/16/32/64 and 10 classes: every layer name a resnet18 job captures, at
    about a sixtieth of its compute. The default model of ``conftest.job()``; a test that compares
    against torchvision's resnet18 itself (or its widths) asks for that by name."""

    def __init__(self, widths: tuple[int, int, int, int] = (8, 16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        from torchvision.models.resnet import BasicBlock

        self.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        blocks, inplanes = [], widths[0]
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or inplanes != planes:
                down = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))
            blocks.append(nn.Sequential(BasicBlock(inplanes, planes, stride, down), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = blocks
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def tiny_resnet() -> nn.Module:
    return TinyResNet()


class PooledTokenNet(nn.Module):
    """A patch embedding (8-pixel patches) whose sequence starts with a token made of the image (the patches' mean):
    no fact tells it from a patch, so which positions are patches is known only when model.prefix_tokens says."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, kernel_size=8, stride=8)
        self.blocks = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.patch(x).flatten(2).transpose(1, 2)  # (B, h * w, width)
        return self.blocks(torch.cat([patches.mean(1, keepdim=True), patches], dim=1))


def pooled_token_net() -> nn.Module:
    return PooledTokenNet()
