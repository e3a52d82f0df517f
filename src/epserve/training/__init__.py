"""Training a small DeepSeek-V3-shaped model and its MTP module on an offline English corpus, written as
a Hugging Face checkpoint: ``corpus`` (the Python reference's help topics, cleaned), ``model`` (the
network in plain torch), ``train`` (the loop and the writer; :func:`train_checkpoint`)."""

from epserve.training.train import TRAIN_PRESETS, train_checkpoint

__all__ = ["TRAIN_PRESETS", "train_checkpoint"]
