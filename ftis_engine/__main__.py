from .app.entry import main

main()
