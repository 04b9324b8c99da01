"""Speculative decoding, all of it: the exact accept/reject rule (rule.py), when and how far to draft (policy.py),
the proposers (proposers.py: n-gram and replay; draft_model.py: a draft model or the target's own first layers;
head_proposer.py: Medusa heads), the verify step on the host path (verify.py) and speculation inside the on-device
decode loop (device_loop.py). Medusa heads are trained by serving/train_heads.py; their layers are model/medusa.py."""
