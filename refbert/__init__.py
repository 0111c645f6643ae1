"""refbert: BERT in NumPy, every backward written by hand and proven by finite differences.

refbert.ops holds the oracle op pairs, refbert.gradcheck checks any forward/backward pair, refbert.model builds BERT
and its heads on them (HF's names and semantics), refbert.tokenization / data / optim / train take text to a trained
model. `refbert check` proves every backward; `refbert trace` shows one step op by op.
"""
from . import gradcheck, ops
from .config import BertConfig
from .model import (BertForMaskedLM, BertForMultipleChoice, BertForNextSentencePrediction, BertForPreTraining,
                    BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification, BertModel,
                    decode_qa_span, get_backend, is_grad_enabled, no_grad, to_numpy)
from .philox import DropoutRNG
from .tokenization import BertTokenizer

__version__ = "0.1.0"
__all__ = ["gradcheck", "ops", "BertConfig", "BertModel", "BertForPreTraining", "BertForMaskedLM",
           "BertForNextSentencePrediction", "BertForSequenceClassification", "BertForTokenClassification",
           "BertForQuestionAnswering", "BertForMultipleChoice", "decode_qa_span", "BertTokenizer", "DropoutRNG",
           "get_backend", "no_grad", "is_grad_enabled", "to_numpy"]
