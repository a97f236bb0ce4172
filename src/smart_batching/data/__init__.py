"""The data room: from files and datasets to token lengths.

==================  ==================================================================================
module              job
==================  ==================================================================================
``readers``         load any data file, folder or hub name as a ``datasets.Dataset`` (:func:`load_dataset_any`)
``formats``         record shapes (text, prompt/completion, chat ``messages``, Alpaca, ...) and their rendering
``tokenizers``      tokenizer aliases and the offline real tokenizers (SmolLM2, GPT-2 BPE, Llama SentencePiece)
``lengths``         token lengths of a dataset, vectorised (:func:`~smart_batching.data.lengths.compute_lengths`)
``default_data``    the embedded default dataset (the demo's data, no download)
==================  ==================================================================================

Imports point down: ``lengths`` reads ``formats`` and ``readers``; nothing here imports the planners.
"""

from smart_batching.data.readers import SUPPORTED_SUFFIXES, file_kind, load_dataset_any

__all__ = ["SUPPORTED_SUFFIXES", "file_kind", "load_dataset_any"]
