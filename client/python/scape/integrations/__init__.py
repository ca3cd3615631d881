"""scape.integrations - scaped inside the training frameworks users run.

Each framework's module is imported on its own (scape.integrations.hf for
the Hugging Face Trainer); importing this package imports no framework.
"""
