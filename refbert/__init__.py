"""refbert: BERT in NumPy, every backward written by hand and proven by finite differences.

The oracle ops live in refbert.ops; refbert.gradcheck checks any forward/backward pair; `refbert check` runs it
over every op.
"""
from . import gradcheck, ops  # noqa: F401

__version__ = "0.1.0"
from .config import BertConfig  # noqa: E402,F401
from .model import (BertForMaskedLM, BertForMultipleChoice, BertForNextSentencePrediction,  # noqa: E402,F401
                    BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
                    BertForTokenClassification, BertModel, decode_qa_span)
from .tokenization import BertTokenizer  # noqa: E402,F401
