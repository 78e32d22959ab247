"""Speculative-decoding proposers: prompt lookup, SuffixDecoding, a draft model (``proposer``)."""
