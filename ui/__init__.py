"""The app's parts that are not wiring: its HTML (render), its words and CSS (page), and each user's session
(session)."""
