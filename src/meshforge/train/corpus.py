"""The run's corpus: its token shards prepared once (cached by content) and checked against
the model and the batch before anything trains on them."""

from __future__ import annotations

from pathlib import Path

from meshforge.data.dataset import TokenDataset
from meshforge.data.prepare import prepared_dir_for
from meshforge.data.tokenizer import load_tokenizer
from meshforge.errors import ConfigError, DataError
from meshforge.models.shape import ModelShape
from meshforge.run_plan import RunPlan
from meshforge.train.packing import check_separator


def dataset_root(cfg: RunPlan) -> Path:
    """Where the token shards for cfg.data live (prepared once, cached by content)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    return prepared_dir_for(cfg.data.path, tok, cfg.data.val_fraction, cfg.data.cache_dir)


def open_data(cfg: RunPlan, shape: ModelShape) -> TokenDataset:
    """Prepare (or reuse) the token shards for cfg.data and check they fit the model and batch."""
    tok = load_tokenizer(cfg.data.tokenizer)
    root = dataset_root(cfg)
    ds = TokenDataset(root, cfg.train.seq_len)
    if ds.tokenizer != tok.name:
        raise DataError(
            f"data at {root} was tokenized with '{ds.tokenizer}', but data.tokenizer = '{cfg.data.tokenizer}' "
            f"('{tok.name}'); set data.tokenizer to the tokenizer the data was prepared with"
        )
    vocab = shape.vocab_size
    if ds.vocab_size > vocab:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the tokenizer's vocabulary ({ds.vocab_size}); "
            f"set --model.vocab_size={ds.vocab_size} (or larger)"
        )
    if len(ds.train) < cfg.train.global_batch_size:
        raise DataError(
            f"the corpus at {cfg.data.path or 'the default corpus'} has {len(ds.train)} training sequences of "
            f"{cfg.train.seq_len + 1} tokens ({ds.train.tokens} tokens), fewer than one global batch of "
            f"{cfg.train.global_batch_size}; add data or lower train.global_batch_size / train.seq_len"
        )
    check_separator(cfg, ds)
    return ds
