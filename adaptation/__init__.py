"""Adapting the draft to the traffic it serves (see docs/architecture.md, "Adaptation").

Pure logic lives in modules tested without Ray (:mod:`adaptation.retention`); the one
Serve deployment (:mod:`adaptation.deployment`) holds it for the whole application."""
