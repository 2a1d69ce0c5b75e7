"""Rollout: workflows that turn prompts into scored samples, and held-out evaluation."""
