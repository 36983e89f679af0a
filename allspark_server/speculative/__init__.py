"""Speculative decoding on rank 0: proposers (ngram.py, draft.py), and speculation.py, which decides who speculates,
turns a verify step's sampled rows into the tokens it emits and keeps the stats."""
