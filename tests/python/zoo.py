"""Real architectures with small random configurations, for tests and benchmarks
(which put tests/python on sys.path).

Nothing is downloaded: transformers and torchvision models are built from configs with
random weights. Each entry returns a ZooCase: the model, example inputs, whether it is
deterministic (no active dropout), and how to get a scalar loss from its output.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class ZooCase:
    name: str
    model: nn.Module
    args: tuple
    kwargs: dict
    deterministic: bool = True  # False when dropout (or another RNG draw) is active
    loss_sums_samples: bool = False  # the loss is a sum over the samples, not a mean

    def loss(self, output: Any) -> torch.Tensor:
        return loss_of(output)

    def share_weight(self, rows: int, batch: int) -> float:
        """What a share of `rows` samples of a batch weighs in the batch's loss (eager gradient
        accumulation's factor): its fraction of the batch for a mean, 1 for a sum."""
        return 1.0 if self.loss_sums_samples else rows / batch

    def counted_tokens(self, kwargs: dict) -> int | None:
        """The label tokens of a padded causal LM's call (shifted by one, -100 not counted),
        which its loss averages over and conveyor counts over the whole call
        (counted_targets.py); None for a call without ignored labels."""
        labels = kwargs.get("labels")
        if not isinstance(labels, torch.Tensor) or not bool((labels == -100).any()):
            return None
        return int((labels[:, 1:] != -100).sum())

    def share_loss(self, model: nn.Module, args: tuple, kwargs: dict, rows: int, batch: int,
                   tokens: int | None) -> torch.Tensor:
        """A share's part of the batch's loss, computed as the pipeline computes it: its
        tokens' summed loss over the whole call's `tokens` (transformers' num_items_in_batch),
        or its loss weighed by share_weight."""
        if tokens is not None:
            return self.loss(model(*args, **kwargs, num_items_in_batch=tokens))
        return self.loss(model(*args, **kwargs)) * self.share_weight(rows, batch)


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: the tensor itself, `.loss`, or the first item."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "loss") and output.loss is not None:
        return output.loss
    if isinstance(output, (tuple, list)):
        return loss_of(output[0])
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise TypeError(f"cannot find a loss in {type(output).__name__}")


class MLP(nn.Module):
    def __init__(self, sizes=(16, 32, 32, 4)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x, target):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, target)


class SmallCNN(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))

    def forward(self, x, labels):
        return F.cross_entropy(self.body(x), labels)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 24), nn.Linear(24, 24), nn.Linear(24, 1)
        self.drop1, self.drop2 = nn.Dropout(0.3), nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop1(torch.tanh(self.fc1(x)))
        h = self.drop2(torch.relu(self.fc2(h))) + F.dropout(h, 0.2, self.training)
        return self.fc3(h).pow(2).mean()


class InPlaceNet(nn.Module):
    """In-place writes: through views, on activations, masked fills, index assignment."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.fc1(x))
        h = h * 1.5
        h[:, :4] += 1.0  # a write through a view
        h.masked_fill_(h > 3.0, 3.0)
        h = self.fc2(h)
        h.add_(x)  # residual, in place
        h[:, 0] = h[:, 1] * 2  # index assignment
        return h.sigmoid().sum()


class UNet3D(nn.Module):
    """A small 3D U-Net: two downsamplings, long skip connections concatenated on the way up."""

    def __init__(self, channels=(2, 4, 8, 16), classes=3):
        super().__init__()
        c_in, c1, c2, c3 = channels

        def block(a, b):
            return nn.Sequential(nn.Conv3d(a, b, 3, padding=1), nn.BatchNorm3d(b), nn.ReLU(inplace=True),
                                 nn.Conv3d(b, b, 3, padding=1), nn.BatchNorm3d(b), nn.ReLU(inplace=True))

        self.enc1, self.enc2, self.mid = block(c_in, c1), block(c1, c2), block(c2, c3)
        self.up2, self.dec2 = nn.ConvTranspose3d(c3, c2, 2, stride=2), block(2 * c2, c2)
        self.up1, self.dec1 = nn.ConvTranspose3d(c2, c1, 2, stride=2), block(2 * c1, c1)
        self.head = nn.Conv3d(c1, classes, 1)

    def forward(self, x, labels):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool3d(e1, 2))
        m = self.mid(F.max_pool3d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return F.cross_entropy(self.head(d1), labels)


def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    return transformers


def mlp(batch=8, dtype=torch.float64) -> ZooCase:
    m = MLP().to(dtype)
    return ZooCase("mlp", m, (torch.randn(batch, 16, dtype=dtype), torch.randn(batch, 4, dtype=dtype)), {})


def cnn_batchnorm(batch=6, dtype=torch.float64) -> ZooCase:
    m = SmallCNN().to(dtype)
    return ZooCase("cnn_batchnorm", m, (torch.randn(batch, 3, 12, 12, dtype=dtype),
                                        torch.randint(0, 5, (batch,))), {})


def resnet18(batch=4, dtype=torch.float64, image=32) -> ZooCase:
    import torchvision
    m = torchvision.models.resnet18(num_classes=10).to(dtype)

    class WithLoss(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, labels):
            return F.cross_entropy(self.net(x), labels)

    return ZooCase("resnet18", WithLoss(m), (torch.randn(batch, 3, image, image, dtype=dtype),
                                             torch.randint(0, 10, (batch,))), {})


def bert(batch=4, seq=16, dtype=torch.float64, layers=2, hidden=32, dropout=0.0) -> ZooCase:
    tf = _quiet_transformers()
    cfg = tf.BertConfig(vocab_size=96, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=max(64, seq),
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    m = tf.BertForMaskedLM(cfg).to(dtype)
    ids = torch.randint(0, 96, (batch, seq))
    return ZooCase("bert", m, (), {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long),
                                   "labels": ids}, deterministic=dropout == 0)


def gpt2(batch=4, seq=16, dtype=torch.float64, layers=2, hidden=32, vocab=96, dropout=0.0) -> ZooCase:
    tf = _quiet_transformers()
    cfg = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=max(128, seq),
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    m = tf.GPT2LMHeadModel(cfg).to(dtype)
    ids = torch.randint(0, vocab, (batch, seq))
    return ZooCase("gpt2", m, (), {"input_ids": ids, "labels": ids}, deterministic=dropout == 0)


def llama(batch=4, seq=16, dtype=torch.float64, layers=2, hidden=32, vocab=96) -> ZooCase:
    """A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU),
    trained on padded batches: an attention mask of each row's length, labels -100 past it."""
    tf = _quiet_transformers()
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(128, seq),
                         use_cache=False, attn_implementation="eager")
    m = tf.LlamaForCausalLM(cfg).to(dtype)
    return ZooCase("llama", m, (), padded_tokens(batch, seq, vocab))


def padded_tokens(batch: int, seq: int, vocab: int, generator: torch.Generator | None = None) -> dict:
    """A padded batch of token rows of random lengths (1 to seq): input_ids, the attention
    mask of each row's length, and labels with -100 (ignored) on the padding."""
    ids = torch.randint(1, vocab, (batch, seq), generator=generator)
    lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
    lengths[0] = seq  # the longest row fills the batch
    mask = (torch.arange(seq) < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def t5(batch=4, seq=12, dtype=torch.float64, layers=2, dropout=0.0) -> ZooCase:
    tf = _quiet_transformers()
    cfg = tf.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                      dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                      use_cache=False)
    m = tf.T5ForConditionalGeneration(cfg).to(dtype)
    ids = torch.randint(2, 96, (batch, seq))
    labels = torch.randint(2, 96, (batch, seq - 2))
    return ZooCase("t5", m, (), {"input_ids": ids, "labels": labels}, deterministic=dropout == 0)


def unet3d(batch=2, dtype=torch.float64, size=8) -> ZooCase:
    m = UNet3D().to(dtype)
    return ZooCase("unet3d", m, (torch.randn(batch, 2, size, size, size, dtype=dtype),
                                 torch.randint(0, 3, (batch, size, size, size))), {})


def dropout_net(batch=8, dtype=torch.float64) -> ZooCase:
    m = DropoutNet().to(dtype)
    return ZooCase("dropout", m, (torch.randn(batch, 12, dtype=dtype),), {}, deterministic=False)


def inplace_net(batch=8, dtype=torch.float64) -> ZooCase:
    m = InPlaceNet().to(dtype)
    return ZooCase("inplace", m, (torch.randn(batch, 8, dtype=dtype),), {}, loss_sums_samples=True)


def qwen2(batch=4, seq=16, dtype=torch.float64, vocab=96) -> ZooCase:
    """Qwen2: grouped-query attention with biased query, key and value projections."""
    tf = _quiet_transformers()
    cfg = tf.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
                         attn_implementation="eager")
    m = tf.Qwen2ForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, vocab, (batch, seq))
    return ZooCase("qwen2", m, (), {"input_ids": ids, "labels": ids})


def gemma2(batch=4, seq=16, dtype=torch.float64, vocab=96) -> ZooCase:
    """Gemma 2: local (sliding-window) and global attention layers, logit soft-capping, tied
    embeddings scaled by the width."""
    tf = _quiet_transformers()
    cfg = tf.Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                          sliding_window=8, use_cache=False, attn_implementation="eager")
    m = tf.Gemma2ForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, vocab, (batch, seq))
    return ZooCase("gemma2", m, (), {"input_ids": ids, "labels": ids})


def bart(batch=4, seq=16, dtype=torch.float64, vocab=96) -> ZooCase:
    """BART: an encoder-decoder with learned positions, embeddings shared three ways."""
    tf = _quiet_transformers()
    cfg = tf.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False)
    m = tf.BartForConditionalGeneration(cfg).to(dtype)
    ids = torch.randint(3, vocab, (batch, seq))
    return ZooCase("bart", m, (), {"input_ids": ids, "labels": ids})


class _Classifier(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


def swin(batch=4, dtype=torch.float64, image=32) -> ZooCase:
    """torchvision's Swin Transformer: shifted windows (roll, masks built per image size),
    relative position biases, patch merging."""
    from torchvision.models.swin_transformer import SwinTransformer
    m = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                        stochastic_depth_prob=0.0, num_classes=5).to(dtype)
    return ZooCase("swin", _Classifier(m), (torch.randn(batch, 3, image, image, dtype=dtype),
                                            torch.randint(0, 5, (batch,))), {})


def convnext(batch=4, dtype=torch.float64, image=32) -> ZooCase:
    """torchvision's ConvNeXt: depthwise 7x7 convolutions, channels-last LayerNorm, layer scale."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    m = ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], stochastic_depth_prob=0.0,
                 num_classes=5).to(dtype)
    return ZooCase("convnext", _Classifier(m), (torch.randn(batch, 3, image, image, dtype=dtype),
                                                torch.randint(0, 5, (batch,))), {})


def mobilenet_v3(batch=4, dtype=torch.float64, image=64) -> ZooCase:
    """torchvision's MobileNetV3 small: hard-swish, squeeze-and-excitation, BatchNorm."""
    import torchvision
    m = torchvision.models.mobilenet_v3_small(num_classes=5, dropout=0.0).to(dtype)
    return ZooCase("mobilenet_v3", _Classifier(m), (torch.randn(batch, 3, image, image, dtype=dtype),
                                                    torch.randint(0, 5, (batch,))), {})


CASES: dict[str, Callable[..., ZooCase]] = {
    "mlp": mlp, "cnn_batchnorm": cnn_batchnorm, "resnet18": resnet18, "bert": bert, "gpt2": gpt2, "llama": llama,
    "t5": t5, "unet3d": unet3d, "dropout": dropout_net, "inplace": inplace_net,
}

# More architectures from transformers and torchvision. Every capture and cut is checked
# against eager on them (tests/python/test_exactness.py), but not every schedule: a pipeline
# test over all of them would take many minutes of the suite on two cores.
MORE_CASES: dict[str, Callable[..., ZooCase]] = {
    "qwen2": qwen2, "gemma2": gemma2, "bart": bart, "swin": swin, "convnext": convnext, "mobilenet_v3": mobilenet_v3,
}


class Tokens(torch.utils.data.Dataset):
    """Rows of random tokens, each its own labels; padded=True: each row has a random length
    (2 to seq) and labels -100 (ignored) past it, so batches count other numbers of label
    tokens (Trainer weighs accumulated batches by them: num_items_in_batch)."""

    def __init__(self, rows: int, seq: int = 16, vocab: int = 96, seed: int = 0, padded: bool = False):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=generator)
        self.labels = self.ids.clone()
        if padded:
            lengths = torch.randint(2, seq + 1, (rows,), generator=generator)
            self.labels[torch.arange(seq) >= lengths[:, None]] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}
