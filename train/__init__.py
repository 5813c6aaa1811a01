"""Training: entry points and the pieces they are composed of."""
