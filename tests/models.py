"""Small models with the features DDP must handle, shared by the DDP tests, and ``same_state`` to compare what
they (and their optimizers) saved."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, d=8, h=16, out=4):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, out)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Tied(nn.Module):
    """Input embedding and output projection share one weight (as in GPT-2)."""

    def __init__(self, vocab=12, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        tokens = (x.abs() * 3).long().clamp(max=11)[:, :3]
        return self.head(torch.tanh(self.mix(self.embed(tokens).mean(1))))[:, :4]


class Frozen(MLP):
    """The first layer is frozen: no hook, no bucket slot."""

    def __init__(self):
        super().__init__()
        self.fc1.requires_grad_(False)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class MixedDtypes(nn.Module):
    """A float64 layer feeding a float32 one: two dtype-homogeneous bucket groups."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16).double()
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4).double()

    def forward(self, x):
        h = torch.tanh(self.fc1(x.double())).float()
        return self.fc3(torch.tanh(self.fc2(h)).double()).float()


class ReverseOrder(nn.Module):
    """Layers registered in one order and used in the opposite one (bucket rebuild matters)."""

    def __init__(self):
        super().__init__()
        self.last, self.middle, self.first = nn.Linear(16, 4), nn.Linear(16, 16), nn.Linear(8, 16)

    def forward(self, x):
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


class Branchy(nn.Module):
    """``branch`` is used only when the flag says so: an unused parameter on demand."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.use_branch = True

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


MODELS = {"mlp": MLP, "tied": Tied, "frozen": Frozen, "batchnorm": WithBatchNorm, "mixed_dtypes": MixedDtypes,
          "reverse_order": ReverseOrder, "branchy": Branchy}


def same_state(a, b) -> bool:
    """Two states (a model's or an optimizer's ``state_dict``, nested dicts and lists) equal bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b
