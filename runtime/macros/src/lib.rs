//! Procedural macros for rtrun.
//!
//! `#[rtrun::actor]` (or `#[rtrun::actor(pub)]` to export the generated reference type) on an
//! `impl` block makes its type an actor: `new` is the constructor, every
//! `pub` method taking `&self` or `&mut self` becomes a remote method, and a typed reference
//! `<Type>Ref` is generated whose methods return `ObjectRef<R>`. `#[rtrun::remote]` on a
//! function registers it as a task callable as `name::remote(args…)`.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::{
    FnArg, ImplItem, ImplItemFn, ItemFn, ItemImpl, Pat, ReturnType, Signature, Type, Visibility,
    parse_macro_input,
};

/// Turns an `impl` block into an actor. See the crate docs.
#[proc_macro_attribute]
pub fn actor(attr: TokenStream, item: TokenStream) -> TokenStream {
    // The generated `<Type>Ref` gets the visibility given here (`#[rtrun::actor(pub)]`); by
    // default it is private to the module, like the items of a plain `struct` declaration.
    let ref_vis = parse_macro_input!(attr as Visibility);
    let item = parse_macro_input!(item as ItemImpl);
    match expand_actor(item, ref_vis) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// Registers a function as a task. See the crate docs.
#[proc_macro_attribute]
pub fn remote(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return syn::Error::new(Span::call_site(), "#[rtrun::remote] takes no arguments")
            .to_compile_error()
            .into();
    }
    let item = parse_macro_input!(item as ItemFn);
    match expand_remote(item) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// An argument of a remote method or function: its name and type.
struct Param {
    name: syn::Ident,
    ty: Type,
}

fn params(sig: &Signature) -> syn::Result<Vec<Param>> {
    sig.inputs
        .iter()
        .filter_map(|arg| match arg {
            FnArg::Receiver(_) => None,
            FnArg::Typed(pat) => Some(pat),
        })
        .enumerate()
        .map(|(i, pat)| {
            let name = match &*pat.pat {
                Pat::Ident(ident) => ident.ident.clone(),
                _ => format_ident!("arg{}", i),
            };
            if matches!(&*pat.ty, Type::Reference(_)) {
                return Err(syn::Error::new(
                    pat.ty.span(),
                    "remote arguments are sent to another process: take them by value",
                ));
            }
            Ok(Param { name, ty: (*pat.ty).clone() })
        })
        .collect()
}

fn return_type(sig: &Signature) -> Type {
    match &sig.output {
        ReturnType::Default => syn::parse_quote!(()),
        ReturnType::Type(_, ty) => (**ty).clone(),
    }
}

/// Generated code that decodes `args` into the parameters' local variables.
fn decode_params(params: &[Param], target: &str) -> TokenStream2 {
    let count = params.len();
    let decodes = params.iter().enumerate().map(|(i, p)| {
        let name = &p.name;
        let ty = &p.ty;
        quote! { let #name: #ty = ::rtrun::__private::decode(&args[#i])?; }
    });
    quote! {
        ::rtrun::__private::expect_args(#target, &args, #count)?;
        #(#decodes)*
    }
}

/// How a method borrows the actor.
enum Receiver {
    Shared,
    Exclusive,
}

fn receiver(method: &ImplItemFn) -> Option<Receiver> {
    match method.sig.inputs.first() {
        Some(FnArg::Receiver(r)) if r.reference.is_some() => {
            Some(if r.mutability.is_some() { Receiver::Exclusive } else { Receiver::Shared })
        }
        _ => None,
    }
}

fn expand_actor(item: ItemImpl, vis: Visibility) -> syn::Result<TokenStream2> {
    if !item.generics.params.is_empty() || item.trait_.is_some() {
        return Err(syn::Error::new(
            item.span(),
            "#[rtrun::actor] goes on an inherent impl block of a non-generic type",
        ));
    }
    let self_ty = &item.self_ty;
    let type_ident = match &**self_ty {
        Type::Path(p) => p.path.segments.last().map(|s| s.ident.clone()),
        _ => None,
    }
    .ok_or_else(|| syn::Error::new(self_ty.span(), "expected a type name"))?;
    let ref_ident = format_ident!("{}Ref", type_ident);
    let type_name_str = type_ident.to_string();

    let mut constructor: Option<&ImplItemFn> = None;
    let mut methods: Vec<&ImplItemFn> = Vec::new();
    for impl_item in &item.items {
        if let ImplItem::Fn(f) = impl_item {
            if f.sig.ident == "new" {
                constructor = Some(f);
            } else if matches!(f.vis, Visibility::Public(_)) && receiver(f).is_some() {
                methods.push(f);
            }
        }
    }
    let constructor = constructor.ok_or_else(|| {
        syn::Error::new(item.span(), "an actor needs a constructor `fn new(..) -> Self`")
    })?;
    let ctor_params = params(&constructor.sig)?;
    let ctor_names: Vec<_> = ctor_params.iter().map(|p| &p.name).collect();
    let ctor_types: Vec<_> = ctor_params.iter().map(|p| &p.ty).collect();
    let ctor_decode = decode_params(&ctor_params, &format!("{type_name_str}::new"));

    let mut ref_methods = Vec::new();
    let mut invoke_arms = Vec::new();
    let mut name_arms = Vec::new();
    for (index, method) in methods.iter().enumerate() {
        let index = u16::try_from(index)
            .map_err(|_| syn::Error::new(method.span(), "too many remote methods"))?;
        let ident = &method.sig.ident;
        let method_name = ident.to_string();
        let method_params = params(&method.sig)?;
        let names: Vec<_> = method_params.iter().map(|p| &p.name).collect();
        let types: Vec<_> = method_params.iter().map(|p| &p.ty).collect();
        let ret = return_type(&method.sig);
        let docs = method.attrs.iter().filter(|a| a.path().is_ident("doc"));
        ref_methods.push(quote! {
            #(#docs)*
            pub fn #ident(&self, #(#names: impl ::rtrun::IntoArg<#types>),*) -> ::rtrun::ObjectRef<#ret> {
                self.0.call(#index, vec![#(::rtrun::IntoArg::into_arg(#names)),*])
            }
        });
        let decode = decode_params(&method_params, &format!("{type_name_str}::{method_name}"));
        let is_async = method.sig.asyncness.is_some();
        let invocation = match (receiver(method), is_async) {
            (Some(Receiver::Exclusive), false) => quote! {
                ::rtrun::actor::Invocation::Exclusive(Box::new(move |this: &mut Self| {
                    ::rtrun::__private::encode(&this.#ident(#(#names),*))
                }))
            },
            (Some(Receiver::Shared), false) => quote! {
                ::rtrun::actor::Invocation::Shared(Box::new(move |this: &Self| {
                    ::rtrun::__private::encode(&this.#ident(#(#names),*))
                }))
            },
            (Some(Receiver::Exclusive), true) => quote! {
                ::rtrun::actor::Invocation::ExclusiveAsync(Box::new(
                    move |mut this: ::rtrun::__private::OwnedRwLockWriteGuard<Self>| -> ::rtrun::__private::MethodFuture {
                        Box::pin(async move { ::rtrun::__private::encode(&this.#ident(#(#names),*).await) })
                    },
                ))
            },
            (Some(Receiver::Shared), true) => quote! {
                ::rtrun::actor::Invocation::SharedAsync(Box::new(
                    move |this: ::rtrun::__private::OwnedRwLockReadGuard<Self>| -> ::rtrun::__private::MethodFuture {
                        Box::pin(async move { ::rtrun::__private::encode(&this.#ident(#(#names),*).await) })
                    },
                ))
            },
            (None, _) => continue,
        };
        invoke_arms.push(quote! {
            #index => {
                #decode
                Ok(#invocation)
            }
        });
        name_arms.push(quote! { #index => #method_name, });
    }

    let registry_ident = format_ident!("__RTRUN_ACTOR_{}", type_name_str.to_uppercase());
    let ref_doc = format!("A reference to a remote [`{type_name_str}`] actor.");
    Ok(quote! {
        #item

        #[doc = #ref_doc]
        #[derive(Clone)]
        #vis struct #ref_ident(::rtrun::ActorRef<#self_ty>);

        impl ::std::fmt::Debug for #ref_ident {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                ::std::fmt::Debug::fmt(&self.0, f)
            }
        }

        impl ::std::ops::Deref for #ref_ident {
            type Target = ::rtrun::ActorRef<#self_ty>;
            fn deref(&self) -> &Self::Target {
                &self.0
            }
        }

        impl ::std::convert::From<::rtrun::ActorRef<#self_ty>> for #ref_ident {
            fn from(inner: ::rtrun::ActorRef<#self_ty>) -> Self {
                #ref_ident(inner)
            }
        }

        impl ::rtrun::__private::serde::Serialize for #ref_ident {
            fn serialize<S: ::rtrun::__private::serde::Serializer>(&self, s: S) -> ::std::result::Result<S::Ok, S::Error> {
                ::rtrun::__private::serde::Serialize::serialize(&self.0, s)
            }
        }

        impl<'de> ::rtrun::__private::serde::Deserialize<'de> for #ref_ident {
            fn deserialize<D: ::rtrun::__private::serde::Deserializer<'de>>(d: D) -> ::std::result::Result<Self, D::Error> {
                <::rtrun::ActorRef<#self_ty> as ::rtrun::__private::serde::Deserialize<'de>>::deserialize(d).map(#ref_ident)
            }
        }

        impl #ref_ident {
            #(#ref_methods)*
        }

        impl #self_ty {
            /// Creates the actor in a new worker process with default options.
            pub fn remote(#(#ctor_names: impl ::rtrun::IntoArg<#ctor_types>),*) -> ::rtrun::Result<#ref_ident> {
                Self::remote_with(::std::default::Default::default(), #(#ctor_names),*)
            }

            /// Creates the actor with options.
            pub fn remote_with(options: ::rtrun::ActorOptions, #(#ctor_names: impl ::rtrun::IntoArg<#ctor_types>),*) -> ::rtrun::Result<#ref_ident> {
                ::rtrun::__private::create_actor::<#self_ty>(options, vec![#(::rtrun::IntoArg::into_arg(#ctor_names)),*])
            }
        }

        impl ::rtrun::Actor for #self_ty {
            type Ref = #ref_ident;
            const TYPE_NAME: &'static str = concat!(module_path!(), "::", #type_name_str);

            #[allow(unused_variables)]
            fn construct(args: ::std::vec::Vec<::rtrun::__private::ObjectBytes>) -> ::rtrun::Result<Self> {
                #ctor_decode
                ::rtrun::__private::IntoConstructed::into_constructed(#self_ty::new(#(#ctor_names),*))
            }

            #[allow(unused_variables, unused_mut)]
            fn invoke(method: u16, args: ::std::vec::Vec<::rtrun::__private::ObjectBytes>) -> ::rtrun::Result<::rtrun::actor::Invocation<Self>> {
                match method {
                    #(#invoke_arms)*
                    other => Err(::rtrun::Error::Invalid(format!(
                        "{} has no method number {}", <Self as ::rtrun::Actor>::TYPE_NAME, other
                    ))),
                }
            }

            fn method_name(method: u16) -> &'static str {
                match method {
                    #(#name_arms)*
                    _ => "<unknown method>",
                }
            }
        }

        #[::rtrun::__private::linkme::distributed_slice(::rtrun::__private::ACTOR_TYPES)]
        #[linkme(crate = ::rtrun::__private::linkme)]
        #[allow(non_upper_case_globals)]
        static #registry_ident: ::rtrun::__private::ActorTypeEntry = ::rtrun::__private::ActorTypeEntry {
            type_name: <#self_ty as ::rtrun::Actor>::TYPE_NAME,
            host: ::rtrun::__private::host::<#self_ty>,
        };
    })
}

fn expand_remote(item: ItemFn) -> syn::Result<TokenStream2> {
    if !item.sig.generics.params.is_empty() {
        return Err(syn::Error::new(
            item.sig.generics.span(),
            "remote functions cannot be generic",
        ));
    }
    let ident = &item.sig.ident;
    let vis = &item.vis;
    let fn_params = params(&item.sig)?;
    let names: Vec<_> = fn_params.iter().map(|p| &p.name).collect();
    let types: Vec<_> = fn_params.iter().map(|p| &p.ty).collect();
    let ret = return_type(&item.sig);
    let name_str = ident.to_string();
    let decode = decode_params(&fn_params, &name_str);
    let call = if item.sig.asyncness.is_some() {
        quote! { ::rtrun::__private::block_on(#ident(#(#names),*))? }
    } else {
        quote! { #ident(#(#names),*) }
    };
    let registry_ident = format_ident!("__RTRUN_TASK_{}", name_str.to_uppercase());
    let doc = format!("Submits [`{name_str}()`] as a task.");
    Ok(quote! {
        #item

        #[doc = #doc]
        #[allow(non_camel_case_types)]
        #vis struct #ident {}

        impl #ident {
            /// The name it is registered under.
            pub const NAME: &'static str = concat!(module_path!(), "::", #name_str);

            /// Runs the function as a task with default options.
            #vis fn remote(#(#names: impl ::rtrun::IntoArg<#types>),*) -> ::rtrun::ObjectRef<#ret> {
                Self::remote_with(::std::default::Default::default(), #(#names),*)
            }

            /// Runs the function as a task with options.
            #vis fn remote_with(options: ::rtrun::TaskOptions, #(#names: impl ::rtrun::IntoArg<#types>),*) -> ::rtrun::ObjectRef<#ret> {
                ::rtrun::__private::submit_task(Self::NAME, options, vec![#(::rtrun::IntoArg::into_arg(#names)),*])
            }
        }

        #[::rtrun::__private::linkme::distributed_slice(::rtrun::__private::TASKS)]
        #[linkme(crate = ::rtrun::__private::linkme)]
        #[allow(non_upper_case_globals)]
        static #registry_ident: ::rtrun::__private::TaskEntry = ::rtrun::__private::TaskEntry {
            name: #ident::NAME,
            run: {
                #[allow(unused_variables)]
                fn run(args: ::std::vec::Vec<::rtrun::__private::ObjectBytes>) -> ::rtrun::Result<::std::vec::Vec<u8>> {
                    #decode
                    ::rtrun::__private::encode(&#call)
                }
                run
            },
        };
    })
}
