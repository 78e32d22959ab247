"""Model-free speculative-decoding proposers: prompt lookup (``ngram_proposer``) and
SuffixDecoding (``suffix_proposer``). Each proposes draft tokens from token ids alone;
the model runner verifies them (a wrong draft costs speed, never correctness)."""
