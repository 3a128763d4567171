"""The run's corpus: its token shards prepared once (cached by content) and checked against
the model and the batch before anything trains on them."""

from __future__ import annotations

from pathlib import Path

from meshforge.config.run_plan import RunPlan
from meshforge.config.sections import TrainConfig
from meshforge.data.dataset import TokenDataset
from meshforge.data.eos_boundaries import single_document_fraction
from meshforge.data.prepare import prepared_dir_for
from meshforge.data.tokenizer import load_tokenizer
from meshforge.errors import ConfigError, DataError
from meshforge.models.shape import ModelShape

WARN_FRACTION = 1.0  # warn when this share of the sampled sequences (all of them) holds a single document


def dataset_root(plan: RunPlan) -> Path:
    """Where the token shards for plan.data live (prepared once, cached by content)."""
    tok = load_tokenizer(plan.data.tokenizer)
    return prepared_dir_for(plan.data.path, tok, plan.data.val_fraction, plan.data.cache_dir)


def open_data(plan: RunPlan, shape: ModelShape) -> TokenDataset:
    """Prepare (or reuse) the token shards for plan.data and check they fit the model and batch."""
    tok = load_tokenizer(plan.data.tokenizer)
    root = dataset_root(plan)
    ds = TokenDataset(root, plan.train.seq_len)
    if ds.tokenizer != tok.name:
        raise DataError(
            f"data at {root} was tokenized with '{ds.tokenizer}', but data.tokenizer = '{plan.data.tokenizer}' "
            f"('{tok.name}'); set data.tokenizer to the tokenizer the data was prepared with"
        )
    vocab = shape.vocab_size
    if ds.vocab_size > vocab:
        raise ConfigError(
            f"model.vocab_size = {vocab} is smaller than the tokenizer's vocabulary ({ds.vocab_size}); "
            f"set --model.vocab_size={ds.vocab_size} (or larger), or leave it out: `auto` takes a tokenizer.json's"
        )
    check_token_ids(ds, vocab)
    if len(ds.train) < plan.train.global_batch_size:
        raise DataError(
            f"the corpus at {plan.data.path or 'the default corpus'} has {len(ds.train)} training sequences of "
            f"{plan.train.seq_len + 1} tokens ({ds.train.tokens} tokens), fewer than one global batch of "
            f"{plan.train.global_batch_size}; add data or lower train.global_batch_size / train.seq_len"
        )
    check_separator(plan, ds)
    return ds


def check_token_ids(ds: TokenDataset, vocab: int) -> None:
    """Every token id must have a row in the model's embedding: the largest one, recorded when the
    shards were prepared (or read from them), is held against the vocabulary before the run starts,
    and every batch against it as it is read (shards changed after their index was written)."""
    top = ds.largest_token()
    if top is not None and top >= vocab:
        raise DataError(
            f"the token shards at {ds.root} hold token id {top}, beyond model.vocab_size = {vocab} (the embedding "
            f"has no row for it); set model.vocab_size to at least {top + 1}, or prepare the data again with the "
            "model's tokenizer"
        )
    ds.train.vocab = ds.val.vocab = vocab


def check_separator(plan: RunPlan, data: TokenDataset) -> None:
    """Packed documents need the corpus's end-of-text token: refuse an index.json without one."""
    if (plan.data.document_mask or plan.data.reset_positions) and type(data.eos_id) is not int:
        raise DataError(
            f"data.document_mask / data.reset_positions need the corpus's end-of-text token, but {data.root} "
            "/ index.json has no integer 'eos_id'; re-run `meshforge data prepare`, or set both to false"
        )


def separator_warning(plan: RunPlan, data: TokenDataset) -> str | None:
    """With data.document_mask on, a corpus whose sampled training sequences all hold a single
    document (no end-of-text separator inside) gets one warning: the mask changes nothing there."""
    if not plan.data.document_mask or data.eos_id is None:
        return None
    fraction, read = single_document_fraction(data.train, int(data.eos_id))
    if read == 0 or fraction < WARN_FRACTION:
        return None
    return (
        f"data.document_mask = true, but {fraction:.0%} of {read} training sequences sampled hold a single document "
        f"(no end-of-text token, id {data.eos_id}, inside): the corpus does not separate its documents, so "
        "attention is plain causal; prepare it with one document per file or JSONL line, or set "
        "data.document_mask = false to silence this"
    )


def split_warnings(tokens: dict[str, int], val_fraction: float) -> list[str]:
    """What ``data prepare`` warns of: a split too small for one global batch of the default
    ``train.seq_len`` and ``train.global_batch_size`` (the printed train command's), so training
    would be refused or evaluation skipped. A val fraction of 0 asked for no validation."""
    t = TrainConfig()
    need = (t.seq_len + 1) * t.global_batch_size
    total = sum(tokens.values())
    batch = f"{t.global_batch_size} sequences of {t.seq_len + 1} tokens, {need:,} tokens"
    out = []
    if tokens.get("train", 0) < need:
        out.append(
            f"the train split holds {tokens.get('train', 0):,} tokens, fewer than one global batch ({batch}, with "
            "the default train.seq_len and train.global_batch_size): add data, or lower those two when you train"
        )
    if val_fraction > 0 and tokens.get("val", 0) < need:
        every = total // (need * 5 // 4)  # every k-th block: a quarter more than one batch, as blocks are whole
        fix = f"raise --val-fraction to {1 / every:.3g} or add data" if every >= 2 else "add data"
        out.append(
            f"the validation split holds {tokens.get('val', 0):,} tokens, fewer than one evaluation batch ({batch}): "
            f"training will report no validation loss; {fix}"
        )
    return out
