"""spec/verify/: verification — greedy and rejection verifiers, their rows, ops and
kernels, and the verify step of a round."""
