"""Scenarios: the `Scenario` Module (cells, arrival profiles, service laws, delays), its
file format and the validation of every field (`scenario`), and the arrival-rate
profiles it carries (`arrivals`)."""
