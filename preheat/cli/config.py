"""`preheat config check`: validate settings, the catalog and local model folders."""

import typer

from preheat.cli.lazy import get_settings, load_catalog

app = typer.Typer(no_args_is_help=True, help="Settings and catalog.")


@app.command()
def check() -> None:
    """Validate PREHEAT_* settings, the catalog, and that local model folders exist."""
    settings = get_settings()
    settings.prefix_store_folder  # noqa: B018 - the workers' settings too: a file there is one line
    catalog = load_catalog(settings.catalog)
    catalog.check_model_paths()
    catalog.check_prompts()
    for model in catalog.models:
        catalog.chat_template(model)  # a file that can only fail is one clear error
    typer.echo(
        f"settings ok; broker {'embedded filesystem' if settings.is_embedded else 'configured'}; "
        f"catalog {settings.catalog}: {len(catalog.models)} model(s), {len(catalog.templates)} template(s), "
        f"{len(catalog.endpoints)} endpoint(s), {len(catalog.schedules)} schedule(s)"
    )
    for model in catalog.models:
        typer.echo(f"model {model}: chat template from {catalog.chat_template_source(model)}")
