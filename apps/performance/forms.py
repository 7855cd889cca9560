from django import forms


class SearchForm(forms.Form):
    """What a search of a pipeline's step is asked: where, which step, how hard."""

    pool = forms.ChoiceField(help_text="a node of it is held aside, out of traffic")
    step = forms.ChoiceField(help_text="the step whose config is searched")
    concurrency = forms.IntegerField(
        min_value=1, max_value=64, initial=8, help_text="users, each sending its next request"
    )
    requests = forms.IntegerField(
        min_value=10, max_value=10_000, initial=200, help_text="a configuration"
    )

    def __init__(self, *args: object, pools: list[str], steps: list[str], **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fields["pool"].choices = [(p, p) for p in pools]  # type: ignore[attr-defined]
        self.fields["step"].choices = [(s, s) for s in steps]  # type: ignore[attr-defined]
