"""lightning-graphcore's IPUStrategy through OpenPopTorch vs Lightning on the CPU.

Runs inside a virtual environment holding lightning==2.0.9 and lightning-graphcore==0.1.0
(``tests_integration/run.sh`` creates it). Lightning drives both runs the same way, so
with the same seed and data the trained weights must be identical.
"""
import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl  # noqa: E402
import lightning_graphcore  # noqa: E402


class Classifier(pl.LightningModule):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(dropout), torch.nn.Linear(16, 3))
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


def _loaders(batch_size=8):
    train = DataLoader(_data(64, 0), batch_size=batch_size, shuffle=False)
    val = DataLoader(_data(32, 1), batch_size=batch_size)
    return train, val


def _trainer(ipu: bool, precision: str = "32-true", **kwargs):
    common = dict(max_epochs=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, deterministic=True)
    common.update(kwargs)
    if ipu:
        return pl.Trainer(accelerator=lightning_graphcore.IPUAccelerator(), devices=1,
                          strategy=lightning_graphcore.IPUStrategy(),
                          plugins=[lightning_graphcore.IPUPrecision(precision)], **common)
    return pl.Trainer(accelerator="cpu", devices=1, **common)


def _fit(ipu: bool, **kwargs):
    torch.manual_seed(0)
    model = Classifier()
    train, val = _loaders()
    trainer = _trainer(ipu, **kwargs)
    trainer.fit(model, train, val)
    return model, trainer


def test_fit_gives_identical_weights_and_metrics():
    cpu_model, cpu_trainer = _fit(ipu=False)
    ipu_model, ipu_trainer = _fit(ipu=True)
    for (name, a), (_, b) in zip(cpu_model.state_dict().items(),
                                 ipu_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert set(cpu_trainer.callback_metrics) == set(ipu_trainer.callback_metrics)
    for key, value in cpu_trainer.callback_metrics.items():
        assert torch.equal(value, ipu_trainer.callback_metrics[key]), key


def test_validate_and_predict_match_cpu():
    torch.manual_seed(0)
    model = Classifier()
    _, val = _loaders()
    cpu = _trainer(ipu=False).validate(copy.deepcopy(model), val, verbose=False)
    ipu = _trainer(ipu=True).validate(copy.deepcopy(model), val, verbose=False)
    assert cpu == ipu
    cpu_pred = _trainer(ipu=False).predict(copy.deepcopy(model), val)
    ipu_pred = _trainer(ipu=True).predict(copy.deepcopy(model), val)
    assert len(cpu_pred) == len(ipu_pred)
    for a, b in zip(cpu_pred, ipu_pred):
        assert torch.equal(a, b)
