"""Framework integrations (optional dependencies): Lightning and the Hugging Face Trainer."""
