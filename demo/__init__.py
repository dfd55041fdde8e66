"""Demo model support: a seeded synthetic multimodal world (``demo.world``) whose
samples train and evaluate a small demo model served by Swallow."""
