"""Demo model support: a seeded synthetic multimodal world (``api.demo.world``) whose
samples train and evaluate a small demo model served by Swallow."""
