"""The reference LLaMA and the model zoo picofx is tested on."""
