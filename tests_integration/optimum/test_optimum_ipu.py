"""optimum-graphcore's IPUTrainer through OpenPopTorch vs plain PyTorch.

Runs inside a virtual environment holding optimum-graphcore==0.7.1, transformers==4.29.2
and openpoptorch-popart (``tests_integration/run.sh`` creates it). A tiny BERT is built
from a config (no download) and trained by IPUTrainer on 1 IPU and on a 2-IPU pipeline,
in fp32 and fp16; plain PyTorch trains a copy of the same model on the same batches with
the same optimizer. Losses (logged per step, evaluation) and weights must agree within
fp32 tolerance (fp16: within half-precision tolerance of the fp32 reference).
"""
import copy
import math

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from optimum.graphcore import IPUConfig, IPUTrainer, IPUTrainingArguments

SEQ, VOCAB, LABELS, MICRO = 8, 64, 3, 2
STEPS, LR = 3, 0.05


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.mask = torch.ones(n, SEQ, dtype=torch.long)
        self.mask[::3, SEQ - 2:] = 0  # some padding, so the attention mask matters
        self.labels = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


class InOrderTrainer(IPUTrainer):
    """IPUTrainer reading the training set in order (the reference reads the same
    batches); the library itself is used unchanged."""

    def _get_train_sampler(self):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _tiny_bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=LABELS)
    return BertForSequenceClassification(config)


def _ipu_config(ipus):
    if ipus == 1:
        return IPUConfig(layers_per_ipu=[-1], ipus_per_replica=1, device_iterations=1,
                         gradient_accumulation_steps=2, inference_device_iterations=1)
    # one encoder layer per IPU; the pipeline needs gradientAccumulation >= 2 * stages - 1
    return IPUConfig(layers_per_ipu=[1, 1], ipus_per_replica=2, device_iterations=1,
                     gradient_accumulation_steps=10, inference_device_iterations=2)


def _run_ipu(ipus, fp32, tmp_path):
    model = _tiny_bert()
    ipu_config = _ipu_config(ipus)
    batch = MICRO * ipu_config.gradient_accumulation_steps
    train, evaluation = Tokens(batch * STEPS, 1), Tokens(8 * ipus, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = IPUTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=MICRO,
                                per_device_eval_batch_size=MICRO, max_steps=STEPS, seed=0,
                                fp32=fp32, logging_steps=1, report_to=[],
                                dataloader_drop_last=True, save_strategy="no")
    trainer = InOrderTrainer(model, ipu_config, args, train_dataset=train,
                             eval_dataset=evaluation, optimizers=(optimizer, scheduler),
                             force_to_pipelined=True)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    eval_loss = trainer.evaluate()["eval_loss"]
    trained = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    return losses, eval_loss, trained, train, evaluation, batch


def _run_reference(train, evaluation, batch):
    model = _tiny_bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for start in range(step * batch, (step + 1) * batch, MICRO):
            items = [train[i] for i in range(start, start + MICRO)]
            inputs = {k: torch.stack([item[k] for item in items]) for k in items[0]}
            loss = model(**inputs).loss
            (loss / (batch // MICRO)).backward()  # ReductionType.Mean over micro-batches
        optimizer.step()
        losses.append(loss.item())  # OutputMode.Final (the IPUConfig's default): the last
    model.eval()
    with torch.no_grad():
        eval_losses = []
        for start in range(0, len(evaluation), MICRO):
            items = [evaluation[i] for i in range(start, start + MICRO)]
            inputs = {k: torch.stack([item[k] for item in items]) for k in items[0]}
            eval_losses.append(model(**inputs).loss.item())
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, sum(eval_losses) / len(eval_losses), trained


@pytest.mark.parametrize("ipus", [1, 2])
@pytest.mark.parametrize("fp32", [True, False], ids=["fp32", "fp16"])
def test_trainer_matches_plain_pytorch(ipus, fp32, tmp_path):
    losses, eval_loss, trained, train, evaluation, batch = _run_ipu(ipus, fp32, tmp_path)
    ref_losses, ref_eval, ref_trained = _run_reference(train, evaluation, batch)
    # logged losses are rounded to 4 decimals by the Trainer
    tol = 2e-4 if fp32 else 2e-2
    assert len(losses) == STEPS
    for got, want in zip(losses, ref_losses):
        assert math.isclose(got, want, abs_tol=tol), (losses, ref_losses)
    assert math.isclose(eval_loss, ref_eval, abs_tol=1e-5 if fp32 else 2e-2)
    common = set(trained) & set(ref_trained)
    assert len(common) >= len(ref_trained) - 2, sorted(set(ref_trained) - common)
    for name in common:
        diff = (trained[name] - ref_trained[name]).abs().max().item()
        assert diff <= (1e-5 if fp32 else 5e-3), (name, diff)
