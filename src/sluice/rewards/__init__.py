"""Reward functions. Built-ins are entries of ``REWARDS`` (a plain dict)."""

from sluice.rewards.exact_match import exact_match_reward

REWARDS = {"exact_match": exact_match_reward}

__all__ = ["REWARDS", "exact_match_reward"]
