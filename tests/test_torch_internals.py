"""The private PyTorch names we rely on live in one module
(``poptorch._runtime.torch_internals``) and still exist in this torch; dynamo settings
are scoped to our own traces."""
import ast
import copy
import pathlib

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._runtime import torch_internals

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "poptorch"
# DataLoader's own private members, used where we subclass or stop it (listed in
# torch_internals.REQUIRED and checked below).
DATALOADER_MODULES = {"data/loader.py", "data/faults.py"}


@pytest.mark.parametrize("name", sorted(torch_internals.REQUIRED))
def test_every_private_torch_name_we_use_exists(name):
    try:
        torch_internals.resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"torch {torch.__version__} no longer has {name} "
                    f"(used for: {torch_internals.REQUIRED[name]}): {error}")


@pytest.mark.parametrize("cls,names", sorted(torch_internals.REQUIRED_ON_INSTANCES.items()))
def test_private_instance_attributes_exist(cls, names):
    instance = torch_internals.resolve(cls)([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    missing = [n for n in names if not hasattr(instance, n)]
    assert not missing, f"torch {torch.__version__}: {cls} instances lack {missing}"


def _private_torch_names(tree: ast.AST) -> list[tuple[int, str]]:
    """``torch.<...>._name`` attribute chains and imports of private torch modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                dotted = ["torch"] + parts[::-1]
                if any(p.startswith("_") and not p.startswith("__") for p in dotted):
                    found.append((node.lineno, ".".join(dotted)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            for module in modules:
                if module.startswith("torch") and any(
                        p.startswith("_") and not p.startswith("__")
                        for p in module.split(".")):
                    found.append((node.lineno, module))
    return found


def test_private_torch_names_are_used_only_through_torch_internals():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ("_runtime/torch_internals.py",) or rel in DATALOADER_MODULES:
            continue
        for line, name in _private_torch_names(ast.parse(path.read_text())):
            bad.append(f"{rel}:{line}: {name}")
    assert not bad, ("use poptorch._runtime.torch_internals (a binding with its reason) "
                     "instead of:\n" + "\n".join(bad))


def test_the_reader_sees_private_names():
    """So that the test above cannot pass by finding nothing."""
    text = (SRC / "_runtime" / "torch_internals.py").read_text()
    assert len(_private_torch_names(ast.parse(text))) > 10


def test_compiled_training_leaves_dynamo_settings_as_they_were(monkeypatch):
    """trace_autograd_ops is on while our program traces (the call is compiled) and off
    again afterwards for the rest of the process; results match plain PyTorch."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    import torch._dynamo
    assert torch._dynamo.config.trace_autograd_ops is False
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = copy.deepcopy(model)

    class WithLoss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            out = self.inner(x)
            return out, F.mse_loss(out, y)

    opts = poptorch.Options()
    opts.Jit.backend("inductor")
    pop = poptorch.trainingModel(WithLoss(model), opts,
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _step in range(3):  # eager, compiles, replays
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        _, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    compiled = pop._program.compiled
    assert compiled is not None and compiled._traced and not compiled.failed
    assert torch._dynamo.config.trace_autograd_ops is False
