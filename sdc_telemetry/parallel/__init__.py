"""One Layout adapter per parallelism: the only place that knows what kind of model is being trained."""
