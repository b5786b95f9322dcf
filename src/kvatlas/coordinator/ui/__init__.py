"""The fleet page: its routes, its data (`/ui/fleet.json`) and its static files."""
