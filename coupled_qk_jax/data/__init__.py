"""Data: corpora, tokenizers, the token cache, the training / evaluation pipeline and MQAR."""

IGNORE_INDEX = -100
"""The target (label) of a position that is not scored: padding, MQAR's unasked positions (torch's
``CrossEntropyLoss`` ``ignore_index`` default)."""
