"""rlrecipes: RL training recipes for LLMs."""
__version__ = "0.1.0"
