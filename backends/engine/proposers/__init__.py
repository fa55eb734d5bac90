"""Speculative decoding's proposers, one module each, behind one protocol
(:class:`~.base.Proposer`): the draft model (:mod:`.draft`), the MTP head (:mod:`.mtp`),
prompt lookup (:mod:`.ngram`) and ``--spec auto``'s choice among them (:mod:`.auto`);
:mod:`.prefill` fills a proposer's KV on the prefill side of disaggregated speculation."""
from .auto import AutoProposer
from .base import MAX_LAG, PLAIN_MAX_LAG, DraftProcess, Proposer, StepHidden
from .draft import DraftModelProposer
from .load import build_proposer, load_proposer_model, make_proposer
from .mtp import MTPProposer
from .ngram import NgramProposer, propose_ngram
from .prefill import ProposerPrefill
from .vocab import DraftVocab, draft_vocab_ids

__all__ = ["MAX_LAG", "PLAIN_MAX_LAG", "AutoProposer", "DraftModelProposer", "DraftProcess", "DraftVocab", "MTPProposer",
           "NgramProposer", "Proposer", "ProposerPrefill", "StepHidden", "build_proposer", "draft_vocab_ids",
           "load_proposer_model",
           "make_proposer", "propose_ngram"]
