"""Rollout: the rollout worker, workflows that turn prompts into scored samples, dynamic group
filters, and held-out evaluation."""
